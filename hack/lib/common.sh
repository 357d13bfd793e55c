# Sourced by hack/cluster.sh, hack/node/node.sh and hack/images.sh: the environment they share and the one
# certificate signer of the local control plane's PKI. It defines no traps and runs nothing.

# Where binaries, images and cluster state live (the scripts' headers say what each holds).
CACHE="${DISAGG_CACHE:-$HOME/.cache/disagg-operator}"
BIN_ROOT="$CACHE/bin"
STATE="${DISAGG_STATE:-$CACHE/cluster}"
PORT_BASE="${DISAGG_PORT_BASE:-16443}"
PKI="$STATE/pki"

# sign_cert PREFIX SUBJECT EXTENSIONS: PREFIX.key (EC P-256: instant to generate, mode 600) and PREFIX.crt, signed
# by the cluster CA ($PKI/ca.crt, ca.key) for ten years with the given x509v3 extensions (one per line).
sign_cert() {
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 -subj "$2" \
    -keyout "$1.key" -out "$1.csr" 2>/dev/null
  printf '%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
    -days 3650 -sha256 -extfile "$1.ext" -out "$1.crt" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
  chmod 600 "$1.key"
}
