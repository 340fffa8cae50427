# Sourced by scripts/setup.sh and scripts/setup_gpu.sh: the packages of a resolved lock that are
# deliberately not installed, named in requirements/excluded.txt (why: that file's comments).
#   EXCLUDED            the names, one array element each
#   lock_without_excluded LOCK   prints LOCK's lines less those packages (names matched as pip does:
#                                case-insensitive, '-', '_' and '.' alike)
EXCLUDED_FILE=requirements/excluded.txt
mapfile -t EXCLUDED < <(sed 's/#.*//; s/[[:space:]]//g; /^$/d' "$EXCLUDED_FILE")

lock_without_excluded() {
  local pattern
  pattern=$(printf '%s|' "${EXCLUDED[@]}" | sed 's/[-_.]/[-_.]/g; s/|$//')
  grep -viE "^[[:space:]]*(${pattern})[[:space:]]*(==|$)" "$1"
}
