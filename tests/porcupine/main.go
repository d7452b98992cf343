// Command porcupine checks a Shoal history for linearizability with Porcupine
// (github.com/anishathalye/porcupine), a checker no one on this project wrote.
//
// Input (stdin): one JSON object per line, one per completed or abandoned client operation:
//
//	{"client":3,"kind":"put","key":"k1","value":"v17","call":1200,"return":1450,"outcome":"ok"}
//	{"client":1,"kind":"get","key":"k1","value":"v17","found":true,"call":1300,"return":1320,"outcome":"ok"}
//	{"client":2,"kind":"delete","key":"k1","call":1500,"return":1600,"outcome":"unknown"}
//
// kind: get | put (upsert) | delete | cas (replace only if the current value is "from").
// outcome: "ok" (the answer was received: for get, value/found say what was read; for
// cas and delete, "applied" says whether it took effect), "fail" (a definite refusal
// before anything changed — left out of the check), or "unknown" (no answer: the write
// may or may not have happened; it is given an open end, as Porcupine's docs advise).
// Times are monotonic nanoseconds from one clock.
//
// Output: "linearizable" (exit 0) or "not linearizable" (exit 1), with counts; on a
// failure, with -viz FILE, Porcupine's HTML visualisation of the history.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"time"

	"github.com/anishathalye/porcupine"
)

type record struct {
	Client  int    `json:"client"`
	Kind    string `json:"kind"`
	Key     string `json:"key"`
	Value   string `json:"value"`
	From    string `json:"from"`
	Found   bool   `json:"found"`
	Applied *bool  `json:"applied"`
	Call    int64  `json:"call"`
	Return  int64  `json:"return"`
	Outcome string `json:"outcome"`
}

type input struct {
	Kind  string
	Key   string
	Value string
	From  string
}

type output struct {
	Found   bool
	Value   string
	Applied bool
	Unknown bool
}

// state of one key: present and its value.
type state struct {
	Present bool
	Value   string
}

var model = porcupine.Model{
	Partition: func(history []porcupine.Operation) [][]porcupine.Operation {
		byKey := map[string][]porcupine.Operation{}
		var order []string
		for _, op := range history {
			k := op.Input.(input).Key
			if _, seen := byKey[k]; !seen {
				order = append(order, k)
			}
			byKey[k] = append(byKey[k], op)
		}
		parts := make([][]porcupine.Operation, 0, len(order))
		for _, k := range order {
			parts = append(parts, byKey[k])
		}
		return parts
	},
	Init: func() interface{} { return state{} },
	Step: func(st, in, out interface{}) (bool, interface{}) {
		s, i, o := st.(state), in.(input), out.(output)
		switch i.Kind {
		case "get":
			return o.Found == s.Present && (!s.Present || o.Value == s.Value), s
		case "put":
			return true, state{Present: true, Value: i.Value}
		case "delete":
			applied := s.Present
			if !o.Unknown && o.Applied != applied {
				return false, s
			}
			return true, state{}
		case "cas":
			applied := s.Present && s.Value == i.From
			if !o.Unknown && o.Applied != applied {
				return false, s
			}
			if applied {
				return true, state{Present: true, Value: i.Value}
			}
			return true, s
		}
		return false, s
	},
	Equal: func(a, b interface{}) bool { return a.(state) == b.(state) },
	DescribeOperation: func(in, out interface{}) string {
		i, o := in.(input), out.(output)
		switch i.Kind {
		case "get":
			if !o.Found {
				return fmt.Sprintf("get(%s) -> absent", i.Key)
			}
			return fmt.Sprintf("get(%s) -> %s", i.Key, o.Value)
		case "cas":
			return fmt.Sprintf("cas(%s, %s -> %s) applied=%v unknown=%v", i.Key, i.From, i.Value, o.Applied, o.Unknown)
		default:
			return fmt.Sprintf("%s(%s, %s) unknown=%v", i.Kind, i.Key, i.Value, o.Unknown)
		}
	},
}

func main() {
	viz := flag.String("viz", "", "write Porcupine's HTML visualisation here when the check fails")
	timeout := flag.Duration("timeout", 5*time.Minute, "give up (exit 2) after this long")
	flag.Parse()

	var ops []porcupine.Operation
	counts := map[string]int{}
	scanner := bufio.NewScanner(os.Stdin)
	scanner.Buffer(make([]byte, 1<<20), 1<<26)
	line := 0
	for scanner.Scan() {
		line++
		if len(scanner.Bytes()) == 0 {
			continue
		}
		var r record
		if err := json.Unmarshal(scanner.Bytes(), &r); err != nil {
			fmt.Fprintf(os.Stderr, "line %d: %v\n", line, err)
			os.Exit(2)
		}
		switch r.Kind {
		case "get", "put", "delete", "cas":
		default:
			fmt.Fprintf(os.Stderr, "line %d: unknown kind %q\n", line, r.Kind)
			os.Exit(2)
		}
		counts[r.Outcome]++
		o := output{Found: r.Found, Value: r.Value, Applied: r.Applied != nil && *r.Applied}
		ret := r.Return
		switch r.Outcome {
		case "ok":
			if r.Return < r.Call {
				fmt.Fprintf(os.Stderr, "line %d: returns before its call\n", line)
				os.Exit(2)
			}
			if (r.Kind == "delete" || r.Kind == "cas") && r.Applied == nil {
				fmt.Fprintf(os.Stderr, "line %d: %s with outcome ok needs \"applied\"\n", line, r.Kind)
				os.Exit(2)
			}
		case "fail":
			continue
		case "unknown":
			if r.Kind == "get" {
				continue // a read with no answer constrains nothing
			}
			o.Unknown = true
			ret = math.MaxInt64
		default:
			fmt.Fprintf(os.Stderr, "line %d: unknown outcome %q\n", line, r.Outcome)
			os.Exit(2)
		}
		ops = append(ops, porcupine.Operation{
			ClientId: r.Client,
			Input:    input{Kind: r.Kind, Key: r.Key, Value: r.Value, From: r.From},
			Call:     r.Call,
			Output:   o,
			Return:   ret,
		})
	}
	if err := scanner.Err(); err != nil {
		fmt.Fprintf(os.Stderr, "reading the history: %v\n", err)
		os.Exit(2)
	}
	result, info := porcupine.CheckOperationsVerbose(model, ops, *timeout)
	fmt.Printf("operations %d (ok %d, unknown %d, failed %d)\n", len(ops), counts["ok"], counts["unknown"], counts["fail"])
	switch result {
	case porcupine.Ok:
		fmt.Println("linearizable")
	case porcupine.Illegal:
		fmt.Println("not linearizable")
		if *viz != "" {
			if err := porcupine.VisualizePath(model, info, *viz); err != nil {
				fmt.Fprintf(os.Stderr, "visualisation: %v\n", err)
			}
		}
		os.Exit(1)
	default:
		fmt.Println("unknown: the checker timed out")
		os.Exit(2)
	}
}
