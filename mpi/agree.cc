// Agreement helpers (see agree.h).
#include "mpi/agree.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>

#include <climits>
#include <cstdint>
#include <map>
#include <stdexcept>

#include "mpi/mpi_check.h"
#include "mpi/watchdog.h"

namespace mpusim {

int AgreeOnWorst(int code) {
  int worst = code;
  watched::Allreduce(&code, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD, WorldLabel());
  return worst;
}

std::vector<std::string> AllGatherStrings(const std::string& mine) {
  int world_size = 1;
  MPUSIM_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  if (mine.size() > static_cast<size_t>(INT_MAX)) {
    throw std::length_error("AllGatherStrings: a rank's text exceeds 2 GiB");
  }
  int length = static_cast<int>(mine.size());
  std::vector<int> lengths(static_cast<size_t>(world_size)), offsets(lengths.size());
  watched::Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, MPI_COMM_WORLD,
                     WorldLabel());
  int64_t total = 0;
  for (size_t r = 0; r < lengths.size(); ++r) {
    offsets[r] = static_cast<int>(total);
    total += lengths[r];
    if (total > INT_MAX) throw std::length_error("AllGatherStrings: the texts exceed 2 GiB");
  }
  std::string all(static_cast<size_t>(total), '\0');
  watched::Allgatherv(mine.data(), length, MPI_CHAR, all.data(), lengths.data(), offsets.data(),
                      MPI_CHAR, MPI_COMM_WORLD, WorldLabel());
  std::vector<std::string> out;
  for (size_t r = 0; r < lengths.size(); ++r) {
    out.push_back(all.substr(static_cast<size_t>(offsets[r]), static_cast<size_t>(lengths[r])));
  }
  return out;
}

bool GatherErrors(const std::string& message, std::vector<std::string>* lines) {
  int world_rank = 0;
  MPUSIM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  const std::vector<std::string> messages = AllGatherStrings(message);
  std::map<std::string, std::vector<size_t>> ranks_of;  // message -> ranks
  for (size_t r = 0; r < messages.size(); ++r) {
    if (!messages[r].empty()) ranks_of[messages[r]].push_back(r);
  }
  if (world_rank == 0) {
    for (const auto& [text, ranks] : ranks_of) {
      lines->push_back(ranks.size() == messages.size()
                           ? text
                           : fmt::format("rank{} {}: {}", ranks.size() > 1 ? "s" : "",
                                         fmt::join(ranks, ","), text));
    }
  }
  return !ranks_of.empty();
}

}  // namespace mpusim
