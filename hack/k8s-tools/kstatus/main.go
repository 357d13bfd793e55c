// Command kstatus prints what sigs.k8s.io/cli-utils/pkg/kstatus/status.Compute (the library Flux's
// health checks and `kubectl wait`-style tools use) makes of Kubernetes objects.
//
// Input: one JSON object per line on stdin. Output: one JSON line per input,
// {"status": "InProgress|Current|Failed|Terminating|Unknown", "message": ..., "conditions": [...]},
// or {"error": ...} for an object Compute refuses. Built by hack/cluster.sh build (COMPONENTS).
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	k8sjson "k8s.io/apimachinery/pkg/util/json"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

type verdict struct {
	Status     string             `json:"status,omitempty"`
	Message    string             `json:"message,omitempty"`
	Conditions []status.Condition `json:"conditions,omitempty"`
	Error      string             `json:"error,omitempty"`
}

func compute(line []byte) verdict {
	obj := map[string]interface{}{}
	// apimachinery's decoder: integers become int64, as the API machinery reads objects
	if err := k8sjson.Unmarshal(line, &obj); err != nil {
		return verdict{Error: fmt.Sprintf("not a JSON object: %v", err)}
	}
	res, err := status.Compute(&unstructured.Unstructured{Object: obj})
	if err != nil {
		return verdict{Error: err.Error()}
	}
	return verdict{Status: string(res.Status), Message: res.Message, Conditions: res.Conditions}
}

func main() {
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 64<<20) // statuses with long messages
	out := json.NewEncoder(os.Stdout)
	for in.Scan() {
		if len(in.Bytes()) == 0 {
			continue
		}
		if err := out.Encode(compute(in.Bytes())); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	if err := in.Err(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
