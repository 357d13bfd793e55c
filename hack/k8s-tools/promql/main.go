// Command promql parses PromQL expressions with Prometheus's own parser (promql/parser, the version
// hack/cluster.sh builds prometheus and promtool at) and names the metrics each one selects, so that tests can
// check every rule and dashboard query against the metrics the components export.
//
// Input: one JSON string (an expression) per line on stdin. Output: one JSON line per input,
// {"metrics": ["name", ...]} (sorted, distinct), or {"error": ...} for an expression that does not parse or
// that selects series without a metric name. Built by hack/cluster.sh build (COMPONENTS).
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"sort"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
)

type result struct {
	Metrics []string `json:"metrics"`
	Error   string   `json:"error,omitempty"`
}

func names(line []byte) result {
	var expr string
	if err := json.Unmarshal(line, &expr); err != nil {
		return result{Error: fmt.Sprintf("not a JSON string: %v", err)}
	}
	parsed, err := parser.NewParser(parser.Options{}).ParseExpr(expr)
	if err != nil {
		return result{Error: err.Error()}
	}
	found := map[string]bool{}
	var unnamed error
	parser.Inspect(parsed, func(node parser.Node, _ []parser.Node) error {
		vs, ok := node.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		name := vs.Name
		for _, m := range vs.LabelMatchers {
			if m.Name == labels.MetricName && m.Type == labels.MatchEqual {
				name = m.Value
			}
		}
		if name == "" {
			unnamed = fmt.Errorf("selector %s names no metric", vs.String())
		}
		found[name] = true
		return nil
	})
	if unnamed != nil {
		return result{Error: unnamed.Error()}
	}
	out := make([]string, 0, len(found))
	for n := range found {
		out = append(out, n)
	}
	sort.Strings(out)
	return result{Metrics: out}
}

func main() {
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 16<<20)
	out := json.NewEncoder(os.Stdout)
	for in.Scan() {
		if len(in.Bytes()) == 0 {
			continue
		}
		if err := out.Encode(names(in.Bytes())); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	if err := in.Err(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
