#!/usr/bin/env bash
# The layout page in a real browser (Debian's chromium, headless): the page draws every GPU,
# and clicking a GPU (the page's #kind=K&rank=R link clicks it on load) outlines exactly the
# ranks of its group of kind K, which must equal what `mpusim layout --rank R --format json`
# says; a screenshot of the page is written next to the build (layout_page.png).
#
# Usage: layout_page_test.sh MPUSIM CHROMIUM SAMPLE_CONFIG_DIR OUT_DIR
set -euo pipefail
mpusim="$1" chromium="$2" samples="$3" out="$4"
work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

browse() {  # browse PAGE FRAGMENT -> the DOM after the page's script ran
  timeout 120 "${chromium}" --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --user-data-dir="${work}/profile" \
    --virtual-time-budget=5000 --dump-dom "file://$1#$2" 2>/dev/null
}

check() {  # check CONFIG KIND RANK
  local config="$1" kind="$2" rank="$3" page="${work}/$(basename "$1" .json).html"
  "${mpusim}" layout "${config}" --format html > "${page}" 2>/dev/null
  local dom ranks cells expected chosen
  dom="$(browse "${page}" "kind=${kind}&rank=${rank}")"
  cells="$(grep -o 'class="gpu[^"]*"' <<< "${dom}" | wc -l)"
  ranks="$(grep -o '"world_size":[0-9]*' "${page}" | head -1 | cut -d: -f2)"
  [[ "${cells}" == "${ranks}" ]] || fail "${config}: ${cells} GPU cells drawn for ${ranks} ranks"
  # The outlined cells, in rank order, against the planner's group of RANK.
  local outlined
  outlined="$(grep -oE '<div class="gpu peer[^"]*" id="g[0-9]+"' <<< "${dom}" |
              grep -oE 'id="g[0-9]+"' | grep -oE '[0-9]+' | sort -n | tr '\n' ' ')"
  expected="$("${mpusim}" layout "${config}" --rank "${rank}" --kinds "${kind}" --format json |
              tr -d ' \n' | grep -oE '"ranks":\[[0-9,]*\]' | head -1 | grep -oE '[0-9]+' |
              sort -n | tr '\n' ' ')"
  [[ -n "${expected}" ]] || fail "${config}: no ${kind} group of rank ${rank} from mpusim layout"
  [[ "${outlined}" == "${expected}" ]] ||
    fail "${config}: clicking g${rank} with kind ${kind} outlines [${outlined}], its group is [${expected}]"
  chosen="$(grep -oE '<div class="gpu[^"]*chosen[^"]*" id="g[0-9]+"' <<< "${dom}" | grep -oE 'g[0-9]+"' | tr -d '"')"
  [[ "${chosen}" == "g${rank}" ]] || fail "${config}: the chosen cell is '${chosen}', not g${rank}"
  grep -q "rank ${rank} on node" <<< "${dom}" || fail "${config}: no coordinates for rank ${rank}"
  echo "ok: ${config##*/}: ${cells} GPUs drawn; g${rank} outlines its ${kind} group [${outlined% }]"
}

check "${samples}/lab_t2_p4_n16.json" pp 5
check "${samples}/lab_t2_p4_n16.json" dp 6
check "${samples}/gpt3_175b_t8_p16_n1024.json" dp 1000
# A screenshot for the labs (docs/labs.md).
"${mpusim}" layout "${samples}/lab_t2_p4_n16.json" --format html > "${work}/shot.html" 2>/dev/null
timeout 120 "${chromium}" --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --user-data-dir="${work}/profile" \
  --window-size=1100,420 --screenshot="${out}/layout_page.png" \
  "file://${work}/shot.html#kind=tp&rank=5" > /dev/null 2>&1
[[ -s "${out}/layout_page.png" ]] || fail "no screenshot"
echo "ok: screenshot ${out}/layout_page.png"
