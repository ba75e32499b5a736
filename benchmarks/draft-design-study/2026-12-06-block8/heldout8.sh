#!/bin/bash
# held-out tau of every arm and the shipped draft at decode block 8 (the arms trained on blocks of 4): the study's
# held-out script at another block, the user sets only
here="$(cd "$(dirname "$0")" && pwd)"
BLOCK=8 WIDE=0 OUT="$here/heldout-tau-block8.jsonl" exec "$here/../2026-12-05/heldout.sh"
