#!/usr/bin/env bash
# Pin docker/Dockerfile's base image by digest: asks the registry for the digest of the tag in
# RAY_IMAGE's default and writes `<tag>@sha256:<digest>` there. Run it where Docker (buildx) can
# reach Docker Hub, review `git diff docker/Dockerfile`, commit. Running it again re-pins the tag
# to whatever the registry serves now (a deliberate update, like `make lock`).
#
#   scripts/pin_base_image.sh [TAG]     # TAG defaults to the tag in the Dockerfile now
set -euo pipefail
cd "$(dirname "$0")/.."
dockerfile=docker/Dockerfile
die() { echo "scripts/pin_base_image.sh: $*" >&2; exit 1; }

current="$(sed -n 's/^ARG RAY_IMAGE=//p' "$dockerfile")"
[ -n "$current" ] || die "no 'ARG RAY_IMAGE=' line in $dockerfile"
tag="${1:-${current%%@*}}"
case "$tag" in *@*|"") die "want an image tag without a digest, got '$tag'" ;; esac

digest="$(docker buildx imagetools inspect "$tag" --format '{{.Manifest.Digest}}')" \
    || die "could not read the digest of $tag (docker buildx imagetools inspect)"
[[ "$digest" =~ ^sha256:[0-9a-f]{64}$ ]] || die "unexpected digest for $tag: '$digest'"

sed -i "s|^ARG RAY_IMAGE=.*|ARG RAY_IMAGE=$tag@$digest|" "$dockerfile"
echo "$dockerfile: FROM $tag@$digest"
