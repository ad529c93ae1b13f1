// Command kstatus prints what sigs.k8s.io/cli-utils' kstatus library makes of Kubernetes objects:
// the status Flux's health checks, Helm 4's --wait and kstatus-based CI read, computed by the
// library itself (status.Compute), not by a reimplementation of its rules.
//
// It reads JSON from stdin (or the files named): one object, a List (`kubectl get ... -o json`
// of several), or a stream of them, and prints one line per object:
//
//	kubectl get ec demo -o json | kstatus            # Current  EdgeConfig/demo  Resource is Ready
//	kubectl get ec -o json | kstatus -o json         # {"kind":"EdgeConfig",...,"status":"Current",...}
//
// The statuses are kstatus's: Current, InProgress, Failed and Terminating from status.Compute;
// Unknown when Compute cannot read the object (the message says why, as kstatus's pollers do);
// NotFound for the API server's `Status` answer to a missing object (`kubectl get --raw`).
//
// Numbers are decoded as Kubernetes decodes them (integers as int64), so `generation` and
// `observedGeneration` compare as the library expects.
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/debug"
	"strings"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

const library = "sigs.k8s.io/cli-utils"

// Result is one object's line in `-o json`.
type Result struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Namespace  string `json:"namespace,omitempty"`
	Name       string `json:"name"`
	Generation int64  `json:"generation"`
	Status     string `json:"status"`
	Message    string `json:"message"`
	// Conditions are the standard conditions kstatus derived (Reconciling or Stalled), if any.
	Conditions []status.Condition `json:"conditions"`
}

func main() {
	output := flag.String("o", "text", "output: text (one line per object) or json (one JSON object per line)")
	version := flag.Bool("version", false, "print the version of "+library+" this binary was built from")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: kstatus [-o text|json] [FILE...]  (no FILE: stdin)\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if *version {
		fmt.Println(libraryVersion())
		return
	}
	if *output != "text" && *output != "json" {
		fail(fmt.Errorf("-o must be text or json, got %q", *output))
	}
	inputs := []io.Reader{os.Stdin}
	if flag.NArg() > 0 {
		inputs = nil
		for _, name := range flag.Args() {
			file, err := os.Open(name)
			if err != nil {
				fail(err)
			}
			defer file.Close()
			inputs = append(inputs, file)
		}
	}
	for _, input := range inputs {
		if err := each(input, func(r Result) error { return write(r, *output) }); err != nil {
			fail(err)
		}
	}
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "kstatus: %v\n", err)
	os.Exit(2)
}

func libraryVersion() string {
	info, ok := debug.ReadBuildInfo()
	if ok {
		for _, module := range info.Deps {
			if module.Path == library {
				return library + " " + module.Version
			}
		}
	}
	return library + " (unknown version)"
}

// each calls emit with the result of every object in a stream of JSON documents.
func each(input io.Reader, emit func(Result) error) error {
	decoder := json.NewDecoder(input)
	for index := 0; ; index++ {
		var raw json.RawMessage
		if err := decoder.Decode(&raw); errors.Is(err, io.EOF) {
			return nil
		} else if err != nil {
			return fmt.Errorf("document %d: not JSON: %w", index+1, err)
		}
		var content map[string]interface{}
		// utiljson turns integers into int64, as the API machinery does; encoding/json would
		// make them float64, which unstructured's NestedInt64 refuses.
		if err := utiljson.Unmarshal(bytes.TrimSpace(raw), &content); err != nil || content == nil {
			return fmt.Errorf("document %d: not a JSON object", index+1)
		}
		objects, err := flatten(content)
		if err != nil {
			return fmt.Errorf("document %d: %w", index+1, err)
		}
		for _, object := range objects {
			if err := emit(compute(object)); err != nil {
				return err
			}
		}
	}
}

// flatten gives the objects of a document: itself, or the items of a List.
func flatten(content map[string]interface{}) ([]*unstructured.Unstructured, error) {
	kind, _ := content["kind"].(string)
	items, isList := content["items"]
	if !isList || !strings.HasSuffix(kind, "List") {
		return []*unstructured.Unstructured{{Object: content}}, nil
	}
	listed, ok := items.([]interface{})
	if !ok && items != nil {
		return nil, fmt.Errorf("%s: items is not a list", kind)
	}
	objects := make([]*unstructured.Unstructured, 0, len(listed))
	for position, item := range listed {
		object, ok := item.(map[string]interface{})
		if !ok {
			return nil, fmt.Errorf("%s: items[%d] is not an object", kind, position)
		}
		objects = append(objects, &unstructured.Unstructured{Object: object})
	}
	return objects, nil
}

func compute(object *unstructured.Unstructured) Result {
	result := Result{
		APIVersion: object.GetAPIVersion(),
		Kind:       object.GetKind(),
		Namespace:  object.GetNamespace(),
		Name:       object.GetName(),
		Generation: object.GetGeneration(),
		Conditions: []status.Condition{},
	}
	if missing, ok := notFound(object); ok {
		result.Kind, result.Name = missing.kind, missing.name
		result.Status, result.Message = string(status.NotFoundStatus), missing.message
		return result
	}
	computed, err := status.Compute(object)
	if err != nil {
		result.Status, result.Message = string(status.UnknownStatus), err.Error()
		return result
	}
	result.Status, result.Message = string(computed.Status), computed.Message
	if computed.Conditions != nil {
		result.Conditions = computed.Conditions
	}
	return result
}

type missingObject struct{ kind, name, message string }

// notFound reads the API server's answer for an object that does not exist:
// {"kind": "Status", "status": "Failure", "reason": "NotFound", "details": {"name", "kind"}}.
func notFound(object *unstructured.Unstructured) (missingObject, bool) {
	content := object.Object
	if object.GetKind() != "Status" || content["reason"] != "NotFound" {
		return missingObject{}, false
	}
	kind, _, _ := unstructured.NestedString(content, "details", "kind")
	name, _, _ := unstructured.NestedString(content, "details", "name")
	message, _ := content["message"].(string)
	return missingObject{kind: kind, name: name, message: message}, true
}

func write(result Result, output string) error {
	if output == "json" {
		line, err := json.Marshal(result)
		if err != nil {
			return err
		}
		_, err = fmt.Printf("%s\n", line)
		return err
	}
	who := result.Kind + "/" + result.Name
	if result.Namespace != "" {
		who = result.Namespace + "/" + who
	}
	_, err := fmt.Printf("%s\t%s\t%s\n", result.Status, who, result.Message)
	return err
}
