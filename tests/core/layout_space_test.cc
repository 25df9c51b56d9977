// core/layout_space: the enumerator yields exactly the layouts an independent count expects,
// each once, each obeying the space's rules, in the axes' order; WriteLayout writes the keys of
// the field tables.
#include "core/layout_space.h"

#include <gtest/gtest.h>

#include <set>
#include <tuple>

#include "core/config/optimizer_config.h"
#include "core/config/parallel_config.h"

namespace mpusim {
namespace {

using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t, int,
                       int64_t>;
Key KeyOf(const Layout& l) {
  return {l.tp, l.cp, l.pp, l.vp, l.sequence_parallel, l.distributed_optimizer,
          l.micro_batch_size, l.ep, l.recompute ? static_cast<int>(*l.recompute) : -1, l.etp};
}

// The sweep's space (cli/sweep_command.cc) counted another way: every ordered (tp, cp, pp, dp)
// of n, each multiplied by its vp (2 choices with pp > 1), sp (2 with tp > 1), the distributed
// optimizer (2 with an optimizer and dp x cp > 1), its ep (the common divisors of dp x cp and
// the experts) and etp (2 with experts and tp > 1).
int64_t SweepCount(int64_t n, int64_t experts, bool has_optimizer) {
  int64_t count = 0;
  for (int64_t tp = 1; tp <= n; ++tp) {
    for (int64_t cp = 1; cp <= n; ++cp) {
      for (int64_t pp = 1; pp <= n; ++pp) {
        if (n % (tp * cp * pp) != 0) continue;
        const int64_t dp_cp = n / (tp * pp);
        int64_t eps = 0;
        for (int64_t ep = 1; ep <= dp_cp; ++ep) {
          eps += dp_cp % ep == 0 && (ep == 1 || (experts > 0 && experts % ep == 0));
        }
        count += (pp > 1 ? 2 : 1) * (tp > 1 ? 2 : 1) * (has_optimizer && dp_cp > 1 ? 2 : 1) * eps *
                 (experts > 0 && tp > 1 ? 2 : 1);
      }
    }
  }
  return count;
}

LayoutSpace SweepSpace(int64_t n, int64_t experts, bool has_optimizer = true) {
  LayoutSpace space;
  space.world_size = n;
  space.virtual_pipeline = LayoutSpace::VirtualPipeline::kTwo;
  space.has_optimizer = has_optimizer;
  space.distributed_optimizer_needs_sharding = true;
  space.num_experts = experts;
  space.whole_experts = true;
  return space;
}

// Advise's space (core/estimate/advise.cc) of a 12-layer model on 16 GPUs of 8 per node.
LayoutSpace AdviseSpace() {
  LayoutSpace space;
  space.world_size = 16;
  space.max_tp = 8;
  space.gpus_per_node = 8;
  space.max_cp = 2;
  space.num_layers = 12;
  space.virtual_pipeline = LayoutSpace::VirtualPipeline::kDividingStageLayers;
  space.has_optimizer = true;
  space.global_batch_size = 32;
  space.micro_batch_sizes = {1, 2, 4, 8};
  space.num_experts = 8;
  space.recompute = {RunConfig::Recompute::kNone, RunConfig::Recompute::kFull};
  return space;
}

// The same count as a plain loop over every value of every axis, filtered by the rules.
int64_t AdviseCount() {
  int64_t count = 0;
  for (int64_t tp : {1, 2, 4, 8}) {
    for (int64_t cp : {1, 2}) {
      for (int64_t pp : {1, 2, 4, 8, 16}) {
        if (16 % (tp * cp * pp) != 0 || 12 % pp != 0) continue;
        const int64_t dp = 16 / (tp * cp * pp);
        for (int64_t vp = 0; vp <= 12; ++vp) {
          if (vp == 1 || (vp > 0 && (pp == 1 || (12 / pp) % vp != 0))) continue;
          for (int sp = 0; sp < 2; ++sp) {
            if (sp == 1 && tp == 1) continue;
            for (int mbs : {1, 2, 4, 8}) {
              if (32 % (mbs * dp) != 0) continue;
              if (vp > 0 && (32 / (mbs * dp)) % pp != 0) continue;
              for (int64_t ep = 1; ep <= dp * cp; ++ep) {
                if ((dp * cp) % ep != 0 || 8 % ep != 0) continue;
                count += 2 /* distributed optimizer */ * 2 /* recompute */;
              }
            }
          }
        }
      }
    }
  }
  return count;
}

TEST(LayoutSpace, SweepSpaceHasTheCountedLayoutsEachOnceAndEachObeysTheRules) {
  for (const auto& [n, experts, has_optimizer] :
       {std::tuple{8, 4, true}, std::tuple{8, 0, true}, std::tuple{12, 6, true},
        std::tuple{1, 0, true}, std::tuple{16, 8, false}, std::tuple{8, 4, false}}) {
    const LayoutSpace space = SweepSpace(n, experts, has_optimizer);
    const std::vector<Layout> layouts = EnumerateLayouts(space);
    std::set<Key> seen;
    for (const Layout& l : layouts) {
      EXPECT_TRUE(SatisfiesRules(space, l)) << l.Name();
      EXPECT_TRUE(seen.insert(KeyOf(l)).second) << "twice: " << l.Name();
      EXPECT_EQ(l.tp * l.cp * l.pp * l.dp, n) << l.Name();
      EXPECT_EQ(l.micro_batch_size, 0);
      EXPECT_FALSE(l.recompute.has_value());
    }
    EXPECT_EQ(static_cast<int64_t>(layouts.size()), SweepCount(n, experts, has_optimizer))
        << n << " ranks, " << experts << " experts";
  }
  // What the sweep listed (run and skipped) before it used the space: 68 + 8 layouts of
  // gpt_sweep_l4_n8.json (an optimizer) and 54 + 90 of gpt_moe_ep2_t2_sp_dp2_n4.json (4
  // experts, no optimizer) on 8 ranks.
  EXPECT_EQ(EnumerateLayouts(SweepSpace(8, 0)).size(), 76u);
  EXPECT_EQ(EnumerateLayouts(SweepSpace(8, 4, false)).size(), 144u);
}

TEST(LayoutSpace, AdviseSpaceHasTheCountedLayoutsEachOnceAndEachObeysTheRules) {
  const LayoutSpace space = AdviseSpace();
  const std::vector<Layout> layouts = EnumerateLayouts(space);
  std::set<Key> seen;
  for (const Layout& l : layouts) {
    EXPECT_TRUE(SatisfiesRules(space, l)) << l.Name();
    EXPECT_TRUE(seen.insert(KeyOf(l)).second) << "twice: " << l.Name();
  }
  EXPECT_EQ(static_cast<int64_t>(layouts.size()), AdviseCount());
}

// The order is the axes' (layout_space.h): the keys ascend with tp outermost, each list in
// its given order (false before true, none before full).
TEST(LayoutSpace, EnumeratesInTheAxesOrder) {
  for (const LayoutSpace& space : {SweepSpace(8, 4), AdviseSpace()}) {
    const std::vector<Layout> layouts = EnumerateLayouts(space);
    ASSERT_GT(layouts.size(), 1u);
    for (size_t i = 1; i < layouts.size(); ++i) {
      EXPECT_LT(KeyOf(layouts[i - 1]), KeyOf(layouts[i]))
          << layouts[i - 1].Name() << " before " << layouts[i].Name();
    }
  }
}

TEST(LayoutSpace, RulesRefuseWhatTheyForbid) {
  const LayoutSpace space = SweepSpace(8, 4);
  Layout l;
  l.dp = 8;
  EXPECT_TRUE(SatisfiesRules(space, l));
  Layout sp = l;  // sequence parallelism needs tp > 1
  sp.sequence_parallel = true;
  EXPECT_FALSE(SatisfiesRules(space, sp));
  Layout vp = l;  // the interleaved schedule needs pp > 1
  vp.vp = 2;
  EXPECT_FALSE(SatisfiesRules(space, vp));
  Layout ep = l;  // ep divides the experts
  ep.ep = 8;
  EXPECT_FALSE(SatisfiesRules(space, ep));
  Layout etp = l;  // whole experts only where tp > 1
  etp.etp = 1;
  EXPECT_FALSE(SatisfiesRules(space, etp));
  Layout dist;  // the distributed optimizer shards over dp x cp > 1 here
  dist.tp = 8;
  dist.distributed_optimizer = true;
  EXPECT_FALSE(SatisfiesRules(space, dist));
  Layout size = l;  // tp cp pp dp = N
  size.dp = 4;
  EXPECT_FALSE(SatisfiesRules(space, size));
  LayoutSpace no_optimizer = space;
  no_optimizer.has_optimizer = false;
  Layout dist8 = l;
  dist8.distributed_optimizer = true;
  EXPECT_TRUE(SatisfiesRules(space, dist8));
  EXPECT_FALSE(SatisfiesRules(no_optimizer, dist8));
}

TEST(LayoutSpace, WriteLayoutWritesTheFieldTablesKeys) {
  using P = ParallelConfig;
  nlohmann::json doc = {{"parallel", {{"order", "tp-cp-ep-dp-pp"}}},
                        {"optimizer", nlohmann::json::object()}};
  Layout l;
  l.tp = 2;
  l.cp = 2;
  l.pp = 2;
  l.vp = 2;
  l.ep = 2;
  l.etp = 1;
  l.sequence_parallel = true;
  l.distributed_optimizer = true;
  l.micro_batch_size = 3;
  WriteLayout(l, 8, &doc);
  const nlohmann::json& par = doc["parallel"];
  EXPECT_EQ(par.size(), 8u) << par.dump();  // the section is the layout's, nothing else
  EXPECT_EQ(par[std::string(ParallelKey(&P::world_size))], 8);
  EXPECT_EQ(par[std::string(ParallelKey(&P::tensor_model_parallel_size))], 2);
  EXPECT_EQ(par[std::string(ParallelKey(&P::context_parallel_size))], 2);
  EXPECT_EQ(par[std::string(ParallelKey(&P::pipeline_model_parallel_size))], 2);
  EXPECT_EQ(par[std::string(ParallelKey(&P::virtual_pipeline_model_parallel_size))], 2);
  EXPECT_EQ(par[std::string(ParallelKey(&P::expert_model_parallel_size))], 2);
  EXPECT_EQ(par[std::string(ParallelKey(&P::expert_tensor_parallel_size))], 1);
  EXPECT_EQ(par[std::string(ParallelKey(&P::sequence_parallel))], true);
  EXPECT_EQ(
      doc["optimizer"][std::string(OptimizerKey(&OptimizerConfig::use_distributed_optimizer))],
      true);
  EXPECT_EQ(doc["run"][std::string(RunKey(&RunConfig::micro_batch_size))], 3);
  // Defaults are left out, and no optimizer section is made.
  nlohmann::json plain = nlohmann::json::object();
  WriteLayout(Layout{}, 1, &plain);
  EXPECT_EQ(plain["parallel"].size(), 4u) << plain.dump();
  EXPECT_FALSE(plain.contains("optimizer"));
  EXPECT_FALSE(plain.contains("run"));
  EXPECT_EQ(l.Name(), "tp 2 cp 2 pp 2 vp 2 dp 1 ep 2 etp 1 sp dist-opt");
}

}  // namespace
}  // namespace mpusim
