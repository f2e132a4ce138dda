// Command promql checks the chart's observability files with the libraries that
// read them for real: Prometheus' own rule-file loader and PromQL parser, and
// Grafana's dashboard model (grafana-foundation-sdk, decoded strictly).
//
//	promql rules     --metrics NAMES FILE  # FILE: a Prometheus rule file (a PrometheusRule's spec)
//	promql dashboard --metrics NAMES FILE  # FILE: a Grafana dashboard JSON
//	promql exprs     --metrics NAMES       # stdin: one PromQL expression per line
//	promql monitors  FILE                  # FILE: a JSON list of ServiceMonitor, PodMonitor, PrometheusRule
//
// monitors decodes prometheus-operator's objects strictly into its own Go types
// (unknown fields and wrong types fail). NAMES holds the metric names the project exports, one a line: every vector
// selector of every expression must name one of them. The report is one JSON
// object on stdout ({"problems": [...], ...: what was found}); exit code 1 when
// there is a problem, 2 on a usage error.
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"regexp"
	"sort"
	"strings"

	"github.com/grafana/grafana-foundation-sdk/go/cog"
	"github.com/grafana/grafana-foundation-sdk/go/cog/plugins"
	"github.com/grafana/grafana-foundation-sdk/go/dashboard"
	"github.com/grafana/grafana-foundation-sdk/go/prometheus"
	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
)

// exprReport is one expression as found, with the metric names it selects.
type exprReport struct {
	Where   string   `json:"where"`
	Expr    string   `json:"expr"`
	Metrics []string `json:"metrics"`
}

type checker struct {
	known    map[string]bool
	parser   parser.Parser
	problems []string
	exprs    []exprReport
}

func (c *checker) problem(format string, args ...any) {
	c.problems = append(c.problems, fmt.Sprintf(format, args...))
}

// expr parses one expression and checks that every selector names a known metric.
func (c *checker) expr(where, text string) {
	node, err := c.parser.ParseExpr(text)
	if err != nil {
		c.problem("%s: %q does not parse: %v", where, text, err)
		return
	}
	names := map[string]bool{}
	parser.Inspect(node, func(n parser.Node, _ []parser.Node) error {
		vs, ok := n.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		name := vs.Name
		for _, m := range vs.LabelMatchers {
			if m.Name != labels.MetricName || name != "" {
				continue
			}
			if m.Type != labels.MatchEqual {
				// a regex over names could match anything: the check needs literal names
				c.problem("%s: %q selects metric names by %s, name them literally", where, text, m.Type)
				return nil
			}
			name = m.Value
		}
		if name == "" {
			c.problem("%s: %q has a selector without a metric name", where, text)
			return nil
		}
		names[name] = true
		return nil
	})
	report := exprReport{Where: where, Expr: text, Metrics: sortedKeys(names)}
	for _, name := range report.Metrics {
		if !c.known[name] {
			c.problem("%s: %q names %s, which the project does not export", where, text, name)
		}
	}
	c.exprs = append(c.exprs, report)
}

func sortedKeys(set map[string]bool) []string {
	keys := make([]string, 0, len(set))
	for k := range set {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// ---------------------------------------------------------------------------
// Rule files

type ruleReport struct {
	Group       string            `json:"group"`
	Alert       string            `json:"alert,omitempty"`
	Record      string            `json:"record,omitempty"`
	Expr        string            `json:"expr"`
	For         string            `json:"for"`
	Labels      map[string]string `json:"labels"`
	Annotations map[string]string `json:"annotations"`
}

// rules loads a rule file the way Prometheus does (rulefmt.Parse: unknown fields,
// durations, label names, annotation templates, expressions), then checks names.
func (c *checker) rules(content []byte) []ruleReport {
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	groups, errs := rulefmt.Parse(content, false, model.UTF8Validation, c.parser, logger)
	for _, err := range errs {
		c.problem("rule file: %v", err)
	}
	if groups == nil {
		return nil
	}
	var out []ruleReport
	for _, g := range groups.Groups {
		for i, r := range g.Rules {
			name := r.Alert
			if name == "" {
				name = r.Record
			}
			c.expr(fmt.Sprintf("group %s rule %d (%s)", g.Name, i, name), r.Expr)
			out = append(out, ruleReport{Group: g.Name, Alert: r.Alert, Record: r.Record, Expr: r.Expr,
				For: r.For.String(), Labels: r.Labels, Annotations: r.Annotations})
		}
	}
	return out
}

// ---------------------------------------------------------------------------
// Grafana dashboards

type panelReport struct {
	Id      uint32   `json:"id"`
	Title   string   `json:"title"`
	Type    string   `json:"type"`
	Row     string   `json:"row,omitempty"`
	Targets []string `json:"targets"`
}

type variableReport struct {
	Name  string `json:"name"`
	Type  string `json:"type"`
	Query string `json:"query,omitempty"`
}

type dashboardReport struct {
	Title     string           `json:"title"`
	Uid       string           `json:"uid"`
	Variables []variableReport `json:"variables"`
	Panels    []panelReport    `json:"panels"`
}

// Grafana's built-in variables that stand for a duration or a number in PromQL.
var builtinSamples = map[string]string{
	"__rate_interval": "5m", "__interval": "1m", "__range": "1h",
	"__interval_ms": "60000", "__range_s": "3600", "__range_ms": "3600000",
}

// $name, ${name}, ${name:format}, [[name]]
var variableRef = regexp.MustCompile(`\$\{([A-Za-z0-9_]+)(?::[^}]*)?\}|\$([A-Za-z0-9_]+)|\[\[([A-Za-z0-9_]+)(?::[^\]]*)?\]\]`)

// labelValues is the Prometheus data source's variable query label_values(selector, label).
var labelValues = regexp.MustCompile(`^\s*label_values\(\s*(.+?)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$`)

type dashboardChecker struct {
	*checker
	dsVar   string            // the datasource variable's name
	samples map[string]string // variable name -> a value to parse expressions with
}

// substitute replaces variable references by sample values, as Grafana would
// interpolate them before sending the query; an unknown variable is a problem.
func (d *dashboardChecker) substitute(where, text string) (string, bool) {
	ok := true
	out := variableRef.ReplaceAllStringFunc(text, func(ref string) string {
		m := variableRef.FindStringSubmatch(ref)
		name := m[1] + m[2] + m[3]
		if v, found := d.samples[name]; found {
			return v
		}
		if v, found := builtinSamples[name]; found {
			return v
		}
		d.problem("%s: %q uses $%s, which is no variable of the dashboard", where, text, name)
		ok = false
		return ref
	})
	return out, ok
}

func strOr(s *string, otherwise string) string {
	if s == nil {
		return otherwise
	}
	return *s
}

// datasourceIsVariable: a reference to the Prometheus data source through the
// dashboard's datasource variable (so users pick their own data source).
func (d *dashboardChecker) datasourceIsVariable(where string, ref *string, typ *string) {
	uid := strOr(ref, "")
	if d.dsVar == "" || (uid != "${"+d.dsVar+"}" && uid != "$"+d.dsVar) {
		d.problem("%s: datasource uid %q is not the datasource variable ${%s}", where, uid, d.dsVar)
	}
	if strOr(typ, "") != "prometheus" {
		d.problem("%s: datasource type %q is not prometheus", where, strOr(typ, ""))
	}
}

func (d *dashboardChecker) variables(list []dashboard.VariableModel) []variableReport {
	var out []variableReport
	seen := map[string]bool{}
	for _, v := range list {
		if seen[v.Name] {
			d.problem("variable %s is defined twice", v.Name)
		}
		seen[v.Name] = true
		if v.Type == dashboard.VariableTypeDatasource {
			if d.dsVar != "" {
				d.problem("more than one datasource variable (%s, %s)", d.dsVar, v.Name)
			}
			d.dsVar = v.Name
		}
		sample := "x"
		if v.Type == dashboard.VariableTypeInterval {
			sample = "5m"
		}
		d.samples[v.Name] = sample
	}
	if d.dsVar == "" {
		d.problem("no datasource variable: the data source must be chosen by the user")
	}
	for _, v := range list {
		query := ""
		if v.Query != nil && v.Query.String != nil {
			query = *v.Query.String
		} else if v.Query != nil && v.Query.Map != nil {
			if q, ok := v.Query.Map["query"].(string); ok {
				query = q
			}
		}
		out = append(out, variableReport{Name: v.Name, Type: string(v.Type), Query: query})
		where := "variable " + v.Name
		switch v.Type {
		case dashboard.VariableTypeDatasource:
			if query != "prometheus" {
				d.problem("%s: a datasource variable of type %q, not prometheus", where, query)
			}
		case dashboard.VariableTypeQuery:
			if v.Datasource == nil {
				d.problem("%s: no datasource", where)
			} else {
				d.datasourceIsVariable(where, v.Datasource.Uid, v.Datasource.Type)
			}
			m := labelValues.FindStringSubmatch(query)
			if m == nil {
				d.problem("%s: query %q is not label_values(selector, label)", where, query)
				continue
			}
			if selector, ok := d.substitute(where, m[1]); ok {
				d.expr(where, selector)
			}
		}
	}
	return out
}

func (d *dashboardChecker) panel(dp *decodedPanel, row string, ids map[uint32]bool) panelReport {
	p := dp.panel
	title := strOr(p.Title, "")
	where := fmt.Sprintf("panel %q", title)
	report := panelReport{Title: title, Type: p.Type, Row: row, Targets: []string{}}
	if title == "" {
		d.problem("a %s panel has no title", p.Type)
	}
	if p.Id == nil {
		d.problem("%s: no id", where)
	} else {
		report.Id = *p.Id
		if ids[*p.Id] {
			d.problem("%s: id %d is used twice", where, *p.Id)
		}
		ids[*p.Id] = true
	}
	if p.GridPos == nil {
		d.problem("%s: no gridPos", where)
	}
	if p.Type == "text" {
		return report
	}
	if p.Datasource == nil {
		d.problem("%s: no datasource", where)
	} else {
		d.datasourceIsVariable(where, p.Datasource.Uid, p.Datasource.Type)
	}
	if len(dp.targets) == 0 {
		d.problem("%s: no Prometheus targets", where)
	}
	refs := map[string]bool{}
	for i, q := range dp.targets {
		twhere := fmt.Sprintf("%s target %d", where, i)
		ref := strOr(q.RefId, "")
		if ref == "" || refs[ref] {
			d.problem("%s: refId %q missing or repeated", twhere, ref)
		}
		refs[ref] = true
		if q.Datasource != nil {
			d.datasourceIsVariable(twhere, q.Datasource.Uid, q.Datasource.Type)
		}
		if strings.TrimSpace(q.Expr) == "" {
			d.problem("%s: empty expr", twhere)
			continue
		}
		report.Targets = append(report.Targets, q.Expr)
		if expr, ok := d.substitute(twhere, q.Expr); ok {
			d.expr(twhere, expr)
		}
	}
	return report
}

// buildError: the SDK's strict decoders return their (possibly empty)
// cog.BuildErrors as an error, so "no error" arrives as a non-nil error holding
// nothing.
func buildError(err error) error {
	var errs cog.BuildErrors
	if errors.As(err, &errs) && len(errs) == 0 {
		return nil
	}
	return err
}

// decodedPanel is a panel with its Prometheus queries.
type decodedPanel struct {
	panel   *dashboard.Panel
	targets []*prometheus.Dataquery
}

// decodedItem is one entry of the dashboard's panels: a panel, or a row with
// the panels a collapsed row holds.
type decodedItem struct {
	panel *decodedPanel
	row   *dashboard.RowPanel
	inRow []decodedPanel
}

// The SDK's PanelOrRowPanel and data query decoders take that empty
// BuildErrors for a failure: they drop every panel and every target that
// decodes cleanly (errors are still reported, so Dashboard.UnmarshalJSONStrict
// serves to report them). The panels and their targets are decoded again here,
// by the same strict decoders, keeping the results.
func decodePanel(c *checker, where string, raw json.RawMessage) *decodedPanel {
	p := &dashboard.Panel{}
	if err := buildError(p.UnmarshalJSONStrict(raw)); err != nil {
		c.problem("%s: %v", where, err)
	}
	var shape struct {
		Targets []json.RawMessage `json:"targets"`
	}
	_ = json.Unmarshal(raw, &shape)
	out := &decodedPanel{panel: p}
	for i, t := range shape.Targets {
		var ds struct {
			Datasource *struct {
				Type string `json:"type"`
			} `json:"datasource"`
		}
		_ = json.Unmarshal(t, &ds)
		kind := ""
		if ds.Datasource != nil {
			kind = ds.Datasource.Type
		} else if p.Datasource != nil {
			kind = strOr(p.Datasource.Type, "")
		}
		if kind != "prometheus" {
			c.problem("%s target %d: not a Prometheus query (datasource type %q)", where, i, kind)
			continue
		}
		q := &prometheus.Dataquery{}
		if err := buildError(q.UnmarshalJSONStrict(t)); err != nil {
			c.problem("%s target %d: %v", where, i, err)
			continue
		}
		out.targets = append(out.targets, q)
	}
	return out
}

func panelsOf(c *checker, content []byte) []decodedItem {
	var raw struct {
		Panels []json.RawMessage `json:"panels"`
	}
	if err := json.Unmarshal(content, &raw); err != nil {
		c.problem("panels: %v", err)
		return nil
	}
	out := make([]decodedItem, len(raw.Panels))
	for i, item := range raw.Panels {
		where := fmt.Sprintf("panels[%d]", i)
		var shape struct {
			Type   string            `json:"type"`
			Panels []json.RawMessage `json:"panels"`
		}
		_ = json.Unmarshal(item, &shape)
		if shape.Type != "row" {
			out[i].panel = decodePanel(c, where, item)
			continue
		}
		out[i].row = &dashboard.RowPanel{}
		if err := buildError(out[i].row.UnmarshalJSONStrict(item)); err != nil {
			c.problem("%s: %v", where, err)
		}
		for j, nested := range shape.Panels {
			out[i].inRow = append(out[i].inRow, *decodePanel(c, fmt.Sprintf("%s.panels[%d]", where, j), nested))
		}
	}
	return out
}

// dashboardJSON decodes strictly into Grafana's dashboard model with every core
// panel and data source plugin registered (so panel options, field configs and
// Prometheus targets are decoded by their own types), validates it, and checks
// data sources, variables, panels and every query.
func (c *checker) dashboardJSON(content []byte) *dashboardReport {
	plugins.RegisterDefaultPlugins()
	var dash dashboard.Dashboard
	if err := buildError(dash.UnmarshalJSONStrict(content)); err != nil {
		c.problem("dashboard does not decode strictly into Grafana's model: %v", err)
		return nil
	}
	if err := buildError(dash.Validate()); err != nil {
		c.problem("dashboard fails Grafana's model validation: %v", err)
	}
	d := &dashboardChecker{checker: c, samples: map[string]string{}}
	report := &dashboardReport{Title: strOr(dash.Title, ""), Uid: strOr(dash.Uid, "")}
	if report.Title == "" || report.Uid == "" {
		c.problem("dashboard needs a title and a uid (provisioning keys it by uid)")
	}
	report.Variables = d.variables(dash.Templating.List)
	ids := map[uint32]bool{}
	row := "" // the row a panel sits under: Grafana lays out an open row's panels after it
	for _, item := range panelsOf(c, content) {
		if item.panel != nil {
			report.Panels = append(report.Panels, d.panel(item.panel, row, ids))
			continue
		}
		row = strOr(item.row.Title, "")
		if ids[item.row.Id] {
			c.problem("row %q: id %d is used twice", row, item.row.Id)
		}
		ids[item.row.Id] = true
		for j := range item.inRow { // a collapsed row holds its panels
			report.Panels = append(report.Panels, d.panel(&item.inRow[j], row, ids))
		}
	}
	if len(report.Panels) == 0 {
		c.problem("dashboard has no panels")
	}
	return report
}

// ---------------------------------------------------------------------------
// prometheus-operator objects

type objectReport struct {
	Kind string `json:"kind"`
	Name string `json:"name"`
}

// monitors decodes each object into prometheus-operator's type for its kind,
// refusing unknown fields (a misspelt or misplaced key would be dropped by the
// API server's pruning, silently).
func (c *checker) monitors(content []byte) []objectReport {
	var objects []json.RawMessage
	if err := json.Unmarshal(content, &objects); err != nil {
		c.problem("not a JSON list of objects: %v", err)
		return nil
	}
	var out []objectReport
	for i, raw := range objects {
		var head struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
			Metadata   struct {
				Name string `json:"name"`
			} `json:"metadata"`
		}
		_ = json.Unmarshal(raw, &head)
		where := fmt.Sprintf("objects[%d] %s %s", i, head.Kind, head.Metadata.Name)
		if head.APIVersion != monitoringv1.SchemeGroupVersion.String() {
			c.problem("%s: apiVersion %q, not %s", where, head.APIVersion, monitoringv1.SchemeGroupVersion)
		}
		var into any
		switch head.Kind {
		case monitoringv1.ServiceMonitorsKind:
			into = &monitoringv1.ServiceMonitor{}
		case monitoringv1.PodMonitorsKind:
			into = &monitoringv1.PodMonitor{}
		case monitoringv1.PrometheusRuleKind:
			into = &monitoringv1.PrometheusRule{}
		default:
			c.problem("%s: not a ServiceMonitor, PodMonitor or PrometheusRule", where)
			continue
		}
		decoder := json.NewDecoder(bytes.NewReader(raw))
		decoder.DisallowUnknownFields()
		if err := decoder.Decode(into); err != nil {
			c.problem("%s: %v", where, err)
		}
		out = append(out, objectReport{Kind: head.Kind, Name: head.Metadata.Name})
	}
	return out
}

// ---------------------------------------------------------------------------

func readNames(path string) (map[string]bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	names := map[string]bool{}
	scanner := bufio.NewScanner(f)
	for scanner.Scan() {
		if line := strings.TrimSpace(scanner.Text()); line != "" {
			names[line] = true
		}
	}
	if len(names) == 0 && scanner.Err() == nil {
		return nil, errors.New("no metric names in " + path)
	}
	return names, scanner.Err()
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: promql {rules|dashboard} --metrics NAMES FILE | promql exprs --metrics NAMES < EXPRS"+
		" | promql monitors FILE")
	os.Exit(2)
}

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	command := os.Args[1]
	flags := flag.NewFlagSet(command, flag.ExitOnError)
	metrics := flags.String("metrics", "", "file of the exported metric names, one a line")
	_ = flags.Parse(os.Args[2:])
	c := &checker{parser: parser.NewParser(parser.Options{})}
	if command != "monitors" {
		if *metrics == "" {
			usage()
		}
		known, err := readNames(*metrics)
		if err != nil {
			fmt.Fprintln(os.Stderr, "promql:", err)
			os.Exit(2)
		}
		c.known = known
	}
	result := map[string]any{}
	switch command {
	case "rules", "dashboard", "monitors":
		if flags.NArg() != 1 {
			usage()
		}
		content, err := os.ReadFile(flags.Arg(0))
		if err != nil {
			fmt.Fprintln(os.Stderr, "promql:", err)
			os.Exit(2)
		}
		switch command {
		case "rules":
			result["rules"] = c.rules(content)
		case "dashboard":
			result["dashboard"] = c.dashboardJSON(content)
		default:
			result["objects"] = c.monitors(content)
		}
	case "exprs":
		scanner := bufio.NewScanner(os.Stdin)
		scanner.Buffer(make([]byte, 1<<20), 1<<20)
		for n := 1; scanner.Scan(); n++ {
			if line := strings.TrimSpace(scanner.Text()); line != "" {
				c.expr(fmt.Sprintf("line %d", n), line)
			}
		}
	default:
		usage()
	}
	result["problems"] = append([]string{}, c.problems...)
	result["expressions"] = append([]exprReport{}, c.exprs...)
	out, _ := json.Marshal(result)
	fmt.Println(string(out))
	if len(c.problems) > 0 {
		os.Exit(1)
	}
}
