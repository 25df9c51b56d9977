// The dump of `mpusim run --dump DIR`: DIR/rankNNNNN.safetensors per rank (this rank's
// tensors with their sharding metadata) and DIR/manifest.json (rank 0).
//
// What it is: the writer; `mpusim diff` (core/dump/diff.h) is the reader. The file format is in
// docs/dumps.md.
// What it is not: a checkpoint (no optimizer state, no way back into a run).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/dump/compare.h"
#include "core/config/config.h"
#include "core/model/record.h"
#include "core/status.h"
#include "core/topology.h"
#include "run/check.h"

namespace mpusim::run {

struct DumpTarget {
  std::string dir;
  std::string config_path;     // the file given, in the manifest as "config_file"
  nlohmann::json config;       // the effective config (EffectiveConfigJson): "config"
  std::string command_line;    // shell-quoted: "command_line"
  std::string backend;      // Backend::name()
  DType dtype = DType::kFloat32;
  std::string run_id;  // 32 hex digits, set by PrepareDump; in the manifest and every rank file
};

// Collective over MPI_COMM_WORLD, before the run: draws the run id (rank 0, broadcast) and
// checks that DIR can be written -- absent, or an empty directory or an earlier dump (which
// the new one replaces), and its parent lets a directory be made -- so that a bad --dump
// fails before anything is printed. Also removes what an earlier dump to DIR that died left
// behind (its hidden temporary siblings). The Status is the same on every rank.
Status PrepareDump(DumpTarget* target);

// Collective over MPI_COMM_WORLD, after PrepareDump. Every file goes to a hidden sibling
// directory ".<name>.mpusim-tmp-<run id>"; once the manifest is written there it is renamed
// to DIR (an earlier dump at DIR is moved aside first and removed after), so DIR is always
// either a complete dump or absent. Host copies are made once per storage (a tensor
// recorded under two names is copied once). Returns a Status on every rank when the directory cannot
// be made or a file cannot be written; *lines (rank 0) then says which ranks failed and why.
// `budgets` (the same on every rank; empty for a run without the check) gives a tensor's
// error budget, written into its manifest entry: {"atol", "rtol"}, every element was allowed
// |value - exact| <= atol + rtol * |exact| by the check (TensorCheck::budget_atol, allowed).
Status WriteDump(const DumpTarget& target, const RankCoordinates& coords,
                 const std::vector<TensorRecord>& records, const HostFetch& fetch,
                 const std::map<std::string, Tolerance>& budgets,
                 std::vector<std::string>* lines);

// The error budgets of a checked run's tensors (those it compared), for WriteDump.
std::map<std::string, Tolerance> ErrorBudgets(const CheckResult& check);

// The sharding metadata of one record, as stored in the safetensors header.
std::string ShardMetadataJson(const TensorRecord& record);

}  // namespace mpusim::run
