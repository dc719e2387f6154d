#!/usr/bin/env bash
# Entry point kept at this path: the set-up lives with the peer's other files, in
# scripts/peers/llamacpp/ (see its setup.sh for what it builds and the environment it reads).
exec bash "$(dirname "${BASH_SOURCE[0]}")/peers/llamacpp/setup.sh" "$@"
