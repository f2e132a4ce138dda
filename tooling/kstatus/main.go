// Command kstatus reads one Kubernetes object as JSON on stdin and prints what
// kstatus (sigs.k8s.io/cli-utils/pkg/kstatus/status, the library Flux and
// cli-utils use to judge health) computes for it, as one JSON line:
//
//	{"status":"Current","message":"...","conditions":[...]}
//
// Errors go to stderr, with exit code 1.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

type output struct {
	Status     string             `json:"status"`
	Message    string             `json:"message"`
	Conditions []status.Condition `json:"conditions"`
}

func run() error {
	data, err := io.ReadAll(os.Stdin)
	if err != nil {
		return fmt.Errorf("reading stdin: %w", err)
	}
	// utiljson turns whole numbers into int64, as the API machinery does: with
	// encoding/json's float64 kstatus silently ignores replica counts (its
	// GetIntField only takes ints) and fails on metadata.generation.
	var obj map[string]interface{}
	if err := utiljson.Unmarshal(data, &obj); err != nil {
		return fmt.Errorf("stdin is not one JSON object: %w", err)
	}
	if obj == nil {
		return fmt.Errorf("stdin is not one JSON object: got null")
	}
	res, err := status.Compute(&unstructured.Unstructured{Object: obj})
	if err != nil {
		return fmt.Errorf("status.Compute: %w", err)
	}
	out := output{Status: res.Status.String(), Message: res.Message, Conditions: res.Conditions}
	if out.Conditions == nil {
		out.Conditions = []status.Condition{}
	}
	return json.NewEncoder(os.Stdout).Encode(out)
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "kstatus: %v\n", err)
		os.Exit(1)
	}
}
