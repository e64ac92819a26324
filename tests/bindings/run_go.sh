#!/usr/bin/env bash
# go test of bindings/go against a staged install (no network: GOPROXY=off).
#   run_go.sh STAGE_PREFIX LIBDIR_NAME WORK_DIR
set -euo pipefail
stage=$1 libdir=$2 work=$3
here=$(cd "$(dirname "$0")/../.." && pwd)
if ! command -v go >/dev/null 2>&1; then echo "skipped: no go"; exit 77; fi
export PKG_CONFIG_PATH="$stage/$libdir/pkgconfig"
export LD_LIBRARY_PATH="$stage/$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export GOCACHE="$work/cache" GOPATH="$work/path" GOFLAGS=-mod=mod GOPROXY=off GO111MODULE=on CGO_ENABLED=1
mkdir -p "$GOCACHE" "$GOPATH"
cd "$here/bindings/go"
go vet ./...
# cgocheck=2 also catches Go pointers stored in C memory.
GODEBUG=cgocheck=2 go test -count=1 ./...
# A consumer module outside the tree, pointing at the checkout as the docs
# say: the module path must be one `go mod` accepts.
consumer="$work/consumer"
rm -rf "$consumer" && mkdir -p "$consumer"
cat > "$consumer/main.go" <<'GO'
package main

import (
	"fmt"

	"ep-moe.dev/epmoe"
)

func main() {
	major, minor, patch := epmoe.Version()
	fmt.Printf("ep_moe %d.%d.%d from a consumer module\n", major, minor, patch)
}
GO
cd "$consumer"
go mod init example.com/consumer >/dev/null 2>&1
go mod edit -require=ep-moe.dev/epmoe@v0.0.0 -replace=ep-moe.dev/epmoe="$here/bindings/go"
go run .
