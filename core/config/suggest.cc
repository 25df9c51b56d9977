// The closest accepted name (see suggest.h).
#include "core/config/suggest.h"

#include <algorithm>
#include <limits>

namespace mpusim {

size_t EditDistance(std::string_view a, std::string_view b) {
  // Three rows of |b| + 1.
  std::vector<size_t> before(b.size() + 1), previous(b.size() + 1), row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) previous[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      row[j] = std::min(
          {previous[j] + 1, row[j - 1] + 1, previous[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        row[j] = std::min(row[j], before[j - 2] + 1);
      }
    }
    std::swap(before, previous);
    std::swap(previous, row);
  }
  return previous[b.size()];
}

namespace {

// A candidate is accepted only when the edits are at most a third of the longer name.
bool CloseEnough(size_t distance, size_t a_size, size_t b_size) {
  return distance * 3 <= std::max(a_size, b_size);
}

}  // namespace

std::string ClosestName(std::string_view unknown, const std::vector<std::string_view>& candidates) {
  if (unknown.size() >= 2) {
    std::string_view only;
    int begun = 0;
    for (std::string_view candidate : candidates) {
      if (candidate.size() > unknown.size() && candidate.starts_with(unknown)) {
        only = candidate;
        ++begun;
      }
    }
    if (begun == 1) return std::string(only);
  }
  std::string best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (std::string_view candidate : candidates) {
    // The distance is at least the difference in length: a name far longer or shorter than
    // the candidate is not measured (a 64 KiB key costs nothing against 40-character names).
    const size_t gap = unknown.size() > candidate.size() ? unknown.size() - candidate.size()
                                                         : candidate.size() - unknown.size();
    if (!CloseEnough(gap, unknown.size(), candidate.size())) continue;
    const size_t d = EditDistance(unknown, candidate);
    if (d < best_distance) {
      best_distance = d;
      best = std::string(candidate);
    }
  }
  // Accept a suggestion only when it shares most of the spelling.
  if (best.empty() || !CloseEnough(best_distance, unknown.size(), best.size())) return "";
  return best;
}

}  // namespace mpusim
