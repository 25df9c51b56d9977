// Agreement helpers (see agree.h).
#include "mpi/agree.h"

#include <mpi.h>

#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "mpi/mpi_check.h"

namespace mpusim {

int AgreeOnWorst(int code) {
  int worst = code;
  MPUSIM_MPI_CHECK(MPI_Allreduce(&code, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
  return worst;
}

bool GatherErrors(const std::string& message, std::vector<std::string>* lines) {
  int world_rank = 0, world_size = 1;
  MPUSIM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  MPUSIM_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  int length = static_cast<int>(message.size());
  std::vector<int> lengths(static_cast<size_t>(world_size), 0);
  MPUSIM_MPI_CHECK(MPI_Gather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, 0, MPI_COMM_WORLD));
  std::vector<int> offsets(lengths.size(), 0);
  int total = 0;
  for (size_t r = 0; r < lengths.size(); ++r) {
    offsets[r] = total;
    total += lengths[r];
  }
  std::string all(static_cast<size_t>(total), '\0');
  MPUSIM_MPI_CHECK(MPI_Gatherv(message.data(), length, MPI_CHAR, all.data(), lengths.data(),
                               offsets.data(), MPI_CHAR, 0, MPI_COMM_WORLD));
  const bool failed = AgreeOnWorst(message.empty() ? 0 : 1) != 0;
  if (world_rank == 0 && failed) {
    std::map<std::string, std::vector<size_t>> ranks_of;
    for (size_t r = 0; r < lengths.size(); ++r) {
      if (lengths[r] > 0) {
        ranks_of[all.substr(static_cast<size_t>(offsets[r]), static_cast<size_t>(lengths[r]))]
            .push_back(r);
      }
    }
    for (const auto& [text, ranks] : ranks_of) {
      lines->push_back(static_cast<int>(ranks.size()) == world_size
                           ? text
                           : fmt::format("rank{} {}: {}", ranks.size() > 1 ? "s" : "",
                                         fmt::join(ranks, ","), text));
    }
  }
  return failed;
}

}  // namespace mpusim
