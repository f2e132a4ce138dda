// Command argohealth reads a Kubernetes object as JSON on stdin (or a JSON array
// of them) and prints the health Argo CD computes for it with the Lua health
// customizations of an argocd-cm ConfigMap, as one JSON line (one per object):
//
//	{"status":"Healthy","message":"...","error":""}
//
//	argohealth --argocd-cm argocd-cm.yaml < obj.json  # a ConfigMap manifest, as Argo CD reads it
//	argohealth --script health.lua < obj.json         # one script, as the object's group_kind health key
//
// (An array is faster than one call per object: loading the settings takes
// about half a second.)
//
// It runs Argo CD's own code, at the release go.mod pins, on the path of
// `argocd admin settings resource-overrides health`
// (cmd/argocd/commands/admin/settings.go): the ConfigMap goes through
// settings.SettingsManager.GetResourceOverrides (which parses the
// `resource.customizations.health.<group>_<kind>` keys), then gitops-engine's
// health.GetResourceHealth with lua.ResourceHealthOverrides, the call the
// application controller makes (controller/health.go). That runs the script in
// util/lua's VM: gopher-lua with only the package, base, table and a safe os
// library open, `obj` a global table, a 1 s timeout, and a table
// with `status` and `message` expected back.
//
// A script that fails is not a failure of this command: Argo CD shows such a
// resource as Unknown with the error as its message, and so does this command,
// with the error also in "error". Usage errors, an object that is not JSON, and
// a kind with no health script configured go to stderr, with exit code 1.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/argoproj/argo-cd/gitops-engine/pkg/health"
	log "github.com/sirupsen/logrus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/kubernetes/fake"
	"sigs.k8s.io/yaml"

	"github.com/argoproj/argo-cd/v3/common"
	"github.com/argoproj/argo-cd/v3/util/lua"
	"github.com/argoproj/argo-cd/v3/util/settings"
)

type output struct {
	Status  string `json:"status"`
	Message string `json:"message"`
	Error   string `json:"error"`
}

// readConfigMap reads an argocd-cm manifest, as the admin command's --argocd-cm-path does.
func readConfigMap(path string) (*corev1.ConfigMap, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var cm *corev1.ConfigMap
	if err := yaml.Unmarshal(data, &cm); err != nil {
		return nil, fmt.Errorf("%s is not a ConfigMap manifest: %w", path, err)
	}
	if cm == nil || cm.Kind != "ConfigMap" || cm.Name != common.ArgoCDConfigMapName {
		return nil, fmt.Errorf("%s is not a ConfigMap named %s", path, common.ArgoCDConfigMapName)
	}
	return cm, nil
}

// scriptConfigMap is an argocd-cm holding one health script under the key of
// each kind among objs.
func scriptConfigMap(path string, objs []*unstructured.Unstructured) (*corev1.ConfigMap, error) {
	script, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	data := map[string]string{}
	for _, obj := range objs {
		gvk := obj.GroupVersionKind()
		groupKind := gvk.Kind
		if gvk.Group != "" {
			groupKind = gvk.Group + "_" + gvk.Kind
		}
		data["resource.customizations.health."+groupKind] = string(script)
	}
	return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: common.ArgoCDConfigMapName}, Data: data}, nil
}

// overrides parses the ConfigMap with Argo CD's settings manager, over a fake
// clientset as the admin command does (createSettingsManager).
func overrides(ctx context.Context, cm *corev1.ConfigMap) (lua.ResourceHealthOverrides, error) {
	cm = cm.DeepCopy()
	cm.Namespace = "default"
	if cm.Labels == nil {
		cm.Labels = map[string]string{}
	}
	cm.Labels["app.kubernetes.io/part-of"] = "argocd" // the settings manager's informer selects on it
	secret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name: common.ArgoCDSecretName, Namespace: "default",
			Labels: map[string]string{"app.kubernetes.io/part-of": "argocd"},
		},
		Data: map[string][]byte{"admin.password": []byte("test"), "server.secretkey": []byte("test")},
	}
	manager := settings.NewSettingsManager(ctx, fake.NewClientset(secret, cm), "default")
	if err := manager.ResyncInformers(); err != nil {
		return nil, fmt.Errorf("loading the ConfigMap: %w", err)
	}
	found, err := manager.GetResourceOverrides()
	if err != nil {
		return nil, fmt.Errorf("reading resource.customizations: %w", err)
	}
	return lua.ResourceHealthOverrides(found), nil
}

// objects reads one object, or a JSON array of them, as the admin command reads
// a resource: whole numbers become int64, as they are in the controller's cache.
func objects(data []byte) ([]*unstructured.Unstructured, error) {
	var raw []json.RawMessage
	if trimmed := strings.TrimSpace(string(data)); strings.HasPrefix(trimmed, "[") {
		if err := json.Unmarshal(data, &raw); err != nil {
			return nil, fmt.Errorf("stdin is not a JSON array of objects: %w", err)
		}
	} else {
		raw = []json.RawMessage{data}
	}
	objs := make([]*unstructured.Unstructured, 0, len(raw))
	for i, item := range raw {
		obj := &unstructured.Unstructured{}
		if err := yaml.Unmarshal(item, obj); err != nil {
			return nil, fmt.Errorf("object %d on stdin is not a Kubernetes object: %w", i, err)
		}
		objs = append(objs, obj)
	}
	return objs, nil
}

// assess is what the application controller records as the object's health.
func assess(obj *unstructured.Unstructured, healthOverrides lua.ResourceHealthOverrides) (output, error) {
	result, err := health.GetResourceHealth(obj, healthOverrides)
	out := output{}
	if err != nil {
		out.Error = err.Error()
	}
	if result == nil && err == nil {
		gvk := obj.GroupVersionKind()
		return out, fmt.Errorf("no health script is configured for %s/%s and Argo CD has no built-in one",
			gvk.Group, gvk.Kind)
	}
	if result != nil {
		out.Status, out.Message = string(result.Status), result.Message
	}
	return out, nil
}

func run() error {
	cmPath := flag.String("argocd-cm", "", "an argocd-cm ConfigMap manifest (YAML or JSON)")
	scriptPath := flag.String("script", "", "a health script, used as the object's kind's resource.customizations.health key")
	flag.Parse()
	if (*cmPath == "") == (*scriptPath == "") || flag.NArg() != 0 {
		return fmt.Errorf("usage: argohealth (--argocd-cm FILE | --script FILE) < object.json")
	}
	data, err := io.ReadAll(os.Stdin)
	if err != nil {
		return fmt.Errorf("reading stdin: %w", err)
	}
	objs, err := objects(data)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	encoder := json.NewEncoder(os.Stdout)
	encoder.SetEscapeHTML(false) // messages quote Lua chunk names such as <string>
	var cm *corev1.ConfigMap
	if *cmPath != "" {
		cm, err = readConfigMap(*cmPath)
	} else {
		cm, err = scriptConfigMap(*scriptPath, objs)
	}
	if err != nil {
		return err
	}
	healthOverrides, err := overrides(ctx, cm)
	if err != nil {
		return err
	}
	for _, obj := range objs {
		out, err := assess(obj, healthOverrides)
		if err != nil {
			return err
		}
		if err := encoder.Encode(out); err != nil {
			return err
		}
	}
	return nil
}

func main() {
	// The settings manager logs its choices (status ignored in diffs...) at info.
	log.SetLevel(log.WarnLevel)
	log.SetOutput(os.Stderr)
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "argohealth: %s\n", strings.TrimSpace(err.Error()))
		os.Exit(1)
	}
}
