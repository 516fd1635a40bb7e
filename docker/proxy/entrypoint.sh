#!/bin/sh
# The proxy container's start (docker-compose.yml: `proxy`): make sure a
# certificate is in /etc/kickass/tls, write nginx's configuration from the
# environment, then run nginx in the foreground.
#
# /etc/kickass/tls holds cert.pem (the certificate chain, leaf first) and
# key.pem (its private key). When neither is there (the first start with the
# `tls` volume), a private CA and a certificate it signs for KICKASS_TLS_NAMES
# are made: ca.pem is what clients trust (the CA's key is thrown away). An
# operator's own certificate goes in the same two files (docker/README.md).
set -eu

tls=/etc/kickass/tls
: "${KICKASS_HTTPS_BIND:=0.0.0.0}"
: "${KICKASS_HTTPS_PORT:=443}"
: "${KICKASS_HTTP_PORT:=8080}"
: "${KICKASS_TLS_NAMES:=DNS:localhost,IP:127.0.0.1}"
: "${KICKASS_TLS_HSTS_MAX_AGE:=0}"

die() {
    echo "ERROR: $1" >&2
    [ $# -lt 2 ] || echo "hint: $2" >&2
    exit 1
}

case "$KICKASS_HTTPS_BIND" in
    '' | *[!0-9.]*) die "KICKASS_HTTPS_BIND must be an IPv4 address, got '$KICKASS_HTTPS_BIND'" ;;
esac
for v in KICKASS_HTTPS_PORT KICKASS_HTTP_PORT KICKASS_TLS_HSTS_MAX_AGE; do
    eval "value=\$$v"
    case "$value" in
        '' | *[!0-9]*) die "$v must be a whole number, got '$value'" ;;
    esac
done

make_certificate() {
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    name=$(printf '%s\n' "$KICKASS_TLS_NAMES" | tr ',' '\n' | sed -n 's/^ *DNS: *//p' | head -n 1)
    [ -n "$name" ] || name=$(printf '%s\n' "$KICKASS_TLS_NAMES" | tr ',' '\n' | sed -n 's/^ *IP: *//p' | head -n 1)
    [ -n "$name" ] || die "KICKASS_TLS_NAMES names nothing: '$KICKASS_TLS_NAMES'" \
        "a comma-separated list such as DNS:measure.example.org,IP:192.0.2.1"
    curve="-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes"
    # shellcheck disable=SC2086  # $curve is several words on purpose
    openssl req -x509 $curve -days 3650 -keyout "$work/ca-key.pem" -out "$work/ca.pem" \
        -subj "/O=Kick-Ass measurement platform/CN=Kick-Ass self-signed CA for $name" \
        -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" 2>"$work/log" ||
        { cat "$work/log" >&2; die "openssl could not make the CA"; }
    # shellcheck disable=SC2086
    openssl req -new $curve -keyout "$work/key.pem" -out "$work/req.pem" \
        -subj "/O=Kick-Ass measurement platform/CN=$name" 2>"$work/log" ||
        { cat "$work/log" >&2; die "openssl could not make the key"; }
    printf '%s\n' \
        "basicConstraints=critical,CA:FALSE" \
        "keyUsage=critical,digitalSignature" \
        "extendedKeyUsage=serverAuth" \
        "subjectAltName=$KICKASS_TLS_NAMES" \
        "subjectKeyIdentifier=hash" \
        "authorityKeyIdentifier=keyid" >"$work/ext.cnf"
    openssl x509 -req -in "$work/req.pem" -CA "$work/ca.pem" -CAkey "$work/ca-key.pem" \
        -CAcreateserial -CAserial "$work/ca.srl" -days 825 -extfile "$work/ext.cnf" \
        -out "$work/leaf.pem" 2>"$work/log" ||
        { cat "$work/log" >&2; die "openssl could not sign the certificate (KICKASS_TLS_NAMES='$KICKASS_TLS_NAMES')" \
            "subjectAltName syntax: DNS:name,IP:address"; }
    cat "$work/leaf.pem" "$work/ca.pem" >"$work/cert.pem"
    chmod 0644 "$work/cert.pem" "$work/ca.pem"
    chmod 0600 "$work/key.pem"
    # The key first: a cert.pem is never there without its key.
    mv "$work/key.pem" "$tls/key.pem.new" && mv "$tls/key.pem.new" "$tls/key.pem"
    mv "$work/ca.pem" "$tls/ca.pem.new" && mv "$tls/ca.pem.new" "$tls/ca.pem"
    mv "$work/cert.pem" "$tls/cert.pem.new" && mv "$tls/cert.pem.new" "$tls/cert.pem"
    rm -rf "$work"
    trap - EXIT
    echo "kickass-proxy: made a self-signed certificate for $KICKASS_TLS_NAMES;" \
        "clients trust $tls/ca.pem (docker/README.md: a real certificate)" >&2
}

if [ -e "$tls/cert.pem" ] || [ -e "$tls/key.pem" ]; then
    [ -s "$tls/cert.pem" ] && [ -s "$tls/key.pem" ] ||
        die "$tls has only one of cert.pem and key.pem" \
            "put both there (the chain and its key), or remove both to get a self-signed one"
else
    make_certificate
fi

if [ "$KICKASS_TLS_HSTS_MAX_AGE" -gt 0 ]; then
    KICKASS_HSTS_DIRECTIVE="add_header Strict-Transport-Security \"max-age=$KICKASS_TLS_HSTS_MAX_AGE\" always;"
else
    KICKASS_HSTS_DIRECTIVE="# HSTS off (KICKASS_TLS_HSTS_MAX_AGE=0)"
fi
export KICKASS_HTTPS_BIND KICKASS_HTTPS_PORT KICKASS_HTTP_PORT KICKASS_HSTS_DIRECTIVE
# Only these: nginx's own $variables stay as they are.
envsubst '${KICKASS_HTTPS_BIND} ${KICKASS_HTTPS_PORT} ${KICKASS_HTTP_PORT} ${KICKASS_HSTS_DIRECTIVE}' \
    </etc/nginx/kickass.conf.template >/etc/nginx/kickass.conf
nginx -t -q -c /etc/nginx/kickass.conf
exec nginx -c /etc/nginx/kickass.conf -g 'daemon off;'
