// Agreement helpers: how the ranks of a job reach one verdict and report an error once.
//
// What it is: collectives over MPI_COMM_WORLD for the end of a step that may fail on some
// ranks only (a missing GPU, a file that cannot be written): every rank learns whether any
// rank failed, and rank 0 gets each distinct message once, so a problem shared by all ranks
// is one line, not one per rank. Every collective is watched (mpi/watchdog.h).
// What it is not: an error handler for MPI itself (mpi_check.h).
#pragma once

#include <string>
#include <vector>

namespace mpusim {

// The largest of every rank's `code` (exit codes: the worst wins).
int AgreeOnWorst(int code);

// Every rank's `mine`, in rank order, on every rank (collective).
std::vector<std::string> AllGatherStrings(const std::string& mine);

// Collective: every rank passes its error message ("" for none). Returns, on every rank,
// whether any rank failed; on rank 0, appends one line per distinct message to *lines,
// prefixed with the ranks that reported it ("ranks 0,2: ...") unless every rank did.
bool GatherErrors(const std::string& message, std::vector<std::string>* lines);

}  // namespace mpusim
