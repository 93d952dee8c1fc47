# x help [COMMAND]: this text; with COMMAND, that command's details
#   The list is made from the command files themselves: each tools/x/COMMAND.sh starts with
#   '# x COMMAND [ARGS]: one-line summary' and then description lines that start with '#   ';
#   ./x lists the commands in its X_COMMANDS order.

x_help() {
  [ $# -le 1 ] || die "help takes at most one command, got '$*'"
  if [ $# -eq 1 ]; then
    x_is_command "$1" || die "help: unknown command '$1'"
    help_of "$1" full
    return
  fi
  echo "usage: ./x <command> [args]   (options of a command may come in any order)"
  echo
  local c
  for c in "${X_COMMANDS[@]}"; do help_of "$c" line; done
  cat <<EOT

Details: ./x help COMMAND, docs/development/testing.md (test, check), docs/guide/torchrun.md (run),
docs/reference/environment.md (FSDP_CACHE_DIR, default $CACHE, and every other variable).
EOT
}

x_is_command() {
  local c
  for c in "${X_COMMANDS[@]}"; do [ "$c" != "$1" ] || return 0; done
  return 1
}

# help_of COMMAND line|full: COMMAND's header (the first line of tools/x/COMMAND.sh) as one
# line of the list, or with its description lines below. A file without that header is an
# error, so a new command cannot be missing from the list.
help_of() {
  local file="$ROOT/tools/x/$1.sh" line usage
  { IFS= read -r line || true; } < "$file"
  if ! [[ "$line" =~ ^"# x "([^:]+)": "(.+)$ ]] || [ "${BASH_REMATCH[1]%% *}" != "$1" ]; then
    die "tools/x/$1.sh: its first line is not '# x $1 [ARGS]: SUMMARY'"
  fi
  usage="${BASH_REMATCH[1]}"
  if [ "$2" = line ]; then printf '  %-27s%s\n' "$usage" "${BASH_REMATCH[2]}"; return; fi
  printf './x %s: %s\n\n' "$usage" "${BASH_REMATCH[2]}"
  # The description: the lines after the header that start with '#   ', up to the first other.
  sed -n '2,${/^#   /!q;s/^#   //p}' "$file"
}
