// Command promlint reads Prometheus text exposition on stdin and reports every problem that
// `promtool check metrics` would: it is the same linter (client_golang's promlint). Exits 1
// listing the problems, 2 when the text cannot be parsed, 0 when it is clean.
package main

import (
	"fmt"
	"os"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
)

func main() {
	problems, err := promlint.New(os.Stdin).Lint()
	if err != nil {
		fmt.Fprintf(os.Stderr, "error while linting: %v\n", err)
		os.Exit(2)
	}
	for _, p := range problems {
		fmt.Printf("%s: %s\n", p.Metric, p.Text)
	}
	if len(problems) > 0 {
		os.Exit(1)
	}
}
