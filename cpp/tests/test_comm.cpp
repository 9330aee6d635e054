// Collectives through the C++ API, on CPU ranks (braid::launch): results equal
// the reduction computed by hand on every rank; collectives are ordered with
// the tasks around them by their declared accesses; a rank function that
// throws fails the job without hanging the other ranks.
#include <chrono>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"

namespace {

using std::chrono::milliseconds;

braid::Runtime rank_runtime(std::size_t rank) {
  return braid::Runtime::builder()
      .backend(braid::BackendKind::Cpu)
      .compute_streams(2)
      .comm_streams(1)
      .profile(true)
      .rank(rank)
      .build();
}

// Throws (failing the rank) when a check inside a rank function fails.
void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

void all_collectives_match_by_hand() {
  for (std::size_t world : {1u, 2u, 3u, 4u}) {
    braid::launch(world, [world](std::size_t rank, braid::Communicator& comm) {
      require(comm.rank() == rank && comm.world_size() == world, "rank and world size");
      require(comm.backend() == "local", "backend");
      braid::Runtime rt = rank_runtime(rank);
      const std::size_t n = 8 * world;
      const float r = static_cast<float>(rank);
      std::vector<float> mine(n);
      for (std::size_t i = 0; i < n; ++i) mine[i] = r * 100.0f + static_cast<float>(i);
      float rank_sum = 0;
      for (std::size_t k = 0; k < world; ++k) rank_sum += static_cast<float>(k) * 100.0f;

      // all_reduce (sum, avg, max), in place.
      braid::Buffer sum = rt.alloc_from("sum", mine);
      comm.all_reduce<float>(rt, sum);
      braid::Buffer avg = rt.alloc_from("avg", mine);
      comm.all_reduce<float>(rt, avg, braid::ReduceOp::Avg);
      braid::Buffer mx = rt.alloc_from("max", mine);
      comm.all_reduce<float>(rt, mx, braid::ReduceOp::Max, "named max");
      // all_reduce_into, i32.
      std::vector<std::int32_t> ints(4, static_cast<std::int32_t>(rank + 1));
      braid::Buffer isend = rt.alloc_from("isend", ints), irecv = rt.alloc("irecv", isend.size());
      comm.all_reduce_into<std::int32_t>(rt, isend, irecv);
      // reduce_scatter (in place): chunk `rank` holds the reduced chunk.
      braid::Buffer rs = rt.alloc_from("rs", mine);
      comm.reduce_scatter<float>(rt, rs);
      // all_gather_into: rank r sends {r, r}.
      braid::Buffer gsend = rt.alloc_from<double>("gsend", {static_cast<double>(rank), static_cast<double>(rank)});
      braid::Buffer grecv = rt.alloc("grecv", 2 * world * sizeof(double));
      comm.all_gather_into<double>(rt, gsend, grecv);
      // broadcast from the last rank.
      braid::Buffer bc = rt.alloc_from("bc", mine);
      comm.broadcast<float>(rt, bc, world - 1);
      comm.barrier(rt);
      require(comm.issued() == 8, "issued " + std::to_string(comm.issued()));

      std::vector<float> s = rt.read_vec<float>(sum), a = rt.read_vec<float>(avg), m = rt.read_vec<float>(mx);
      std::vector<float> chunk = rt.read_vec<float>(rs), b = rt.read_vec<float>(bc);
      for (std::size_t i = 0; i < n; ++i) {
        const float expect = rank_sum + static_cast<float>(world) * static_cast<float>(i);
        require(s[i] == expect, "sum[" + std::to_string(i) + "]");
        require(a[i] == expect / static_cast<float>(world), "avg[" + std::to_string(i) + "]");
        require(m[i] == static_cast<float>(world - 1) * 100.0f + static_cast<float>(i), "max");
        require(b[i] == static_cast<float>(world - 1) * 100.0f + static_cast<float>(i), "broadcast");
        const std::size_t per = n / world;
        if (i / per == rank) require(chunk[i] == expect, "reduce_scatter chunk");
      }
      std::int32_t isum = 0;
      for (std::size_t k = 0; k < world; ++k) isum += static_cast<std::int32_t>(k + 1);
      for (std::int32_t v : rt.read_vec<std::int32_t>(irecv)) require(v == isum, "i32 sum");
      std::vector<double> g = rt.read_vec<double>(grecv);
      for (std::size_t i = 0; i < g.size(); ++i) require(g[i] == static_cast<double>(i / 2), "all_gather");
      bool named = false;
      for (const auto& sp : rt.spans()) named = named || (sp.name == "named max" && sp.kind == braid::TaskKind::Comm);
      require(named, "the named collective's span");
      rt.synchronize();
    });
  }
}

// A collective runs after the task that writes its input and before the task
// that reads its output, whatever the streams.
void collectives_are_ordered_by_their_accesses() {
  braid::launch(2, [](std::size_t rank, braid::Communicator& comm) {
    braid::Runtime rt = rank_runtime(rank);
    braid::Buffer grads = rt.alloc("grads", 1024 * sizeof(float));
    braid::Buffer out = rt.alloc("out", grads.size());
    rt.task("backward").run(braid::write<float>(grads), [rank](braid::Span<float> out) {
      std::this_thread::sleep_for(milliseconds(30));
      for (float& g : out) g = static_cast<float>(rank + 1);
    });
    comm.all_reduce<float>(rt, grads, braid::ReduceOp::Sum);
    rt.task("step").run(braid::read<float>(grads), braid::write<float>(out), [](braid::Span<const float> in, braid::Span<float> o) {
      for (std::size_t i = 0; i < in.size(); ++i) o[i] = in[i] * 2.0f;
    });
    for (float v : rt.read_vec<float>(out)) require(v == 6.0f, "step saw the reduced gradients");
  });
}

// Two ranks record a step with a collective in it, agree on its placement and
// replay it: the replays compute what the recording did, and both ranks place
// the schedule alike. A schedule recorded on another runtime is refused.
void ranks_agree_on_a_schedules_placement() {
  braid::launch(2, [](std::size_t rank, braid::Communicator& comm) {
    braid::Runtime rt = rank_runtime(rank);
    braid::Buffer g = rt.alloc("g", 256 * sizeof(float));
    braid::Buffer w = rt.alloc("w", 256 * sizeof(float));
    braid::Schedule step = rt.record("step", [&](const braid::Runtime& r) {
      r.task("grad").run(braid::write<float>(g), [rank](braid::Span<float> out) {
        std::this_thread::sleep_for(milliseconds(rank == 0 ? 5 : 1));
        for (float& x : out) x = static_cast<float>(rank + 1);
      });
      comm.all_reduce<float>(r, g, braid::ReduceOp::Sum);
      r.task("update").run(braid::read<float>(g), braid::read_write<float>(w),
                           [](braid::Span<const float> in, braid::Span<float> o) {
                             for (std::size_t i = 0; i < in.size(); ++i) o[i] += in[i];
                           });
    });
    rt.synchronize();
    comm.agree_placement(rt, step);
    for (int i = 0; i < 3; ++i) step.replay();
    for (float v : rt.read_vec<float>(w)) require(v == 12.0f, "four steps of +3");
    require(step.streams_used() >= 1, "the replays ran on the streams of the plan");

    braid::Runtime other = rank_runtime(rank);
    braid::Schedule foreign = other.record("foreign", [](const braid::Runtime& r) {
      braid::Buffer b = r.alloc("b", 4);
      r.task("t").run(braid::write<float>(b), [](braid::Span<float> o) { o[0] = 1.0f; });
    });
    bool threw = false;
    try {
      comm.agree_placement(rt, foreign);
    } catch (const braid::Error& e) {
      threw = std::string(e.what()).find("another runtime") != std::string::npos;
    }
    require(threw, "a schedule of another runtime is refused");
    rt.synchronize();
  });
}

// With graphs, a step with a collective is cut around it (two graphs, the
// all-reduce between them); with graph_collectives it is one graph. Both
// compute what the recording did.
void a_step_with_its_collective_replays_as_one_graph() {
  for (bool collectives : {false, true}) {
    braid::launch(2, [collectives](std::size_t rank, braid::Communicator& comm) {
      braid::Runtime rt = braid::Runtime::builder()
                              .backend(braid::BackendKind::Cpu)
                              .compute_streams(2)
                              .rank(rank)
                              .graphs()
                              .graph_collectives(collectives)
                              .build();
      braid::Buffer g = rt.alloc("g", 64 * sizeof(float));
      braid::Buffer w = rt.alloc("w", 64 * sizeof(float));
      braid::Schedule step = rt.record("step", [&](const braid::Runtime& r) {
        r.task("grad").run(braid::write<float>(g), [rank](braid::Span<float> out) {
          for (float& x : out) x = static_cast<float>(rank + 1);
        });
        comm.all_reduce<float>(r, g, braid::ReduceOp::Sum);
        r.task("update").run(braid::read<float>(g), braid::read_write<float>(w),
                             [](braid::Span<const float> in, braid::Span<float> o) {
                               for (std::size_t i = 0; i < in.size(); ++i) o[i] += in[i];
                             });
      });
      for (int i = 0; i < 3; ++i) step.replay();
      for (float v : rt.read_vec<float>(w)) require(v == 12.0f, "four steps of +3");
      require(step.graph_refusal().empty(), "a graph");
      require(step.graph_collectives_left_out().empty(), "nothing left out on the CPU");
      const std::size_t graphs = collectives ? 1 : 2, between = collectives ? 0 : 1;
      require(step.graphs_per_replay() == graphs && step.tasks_between_graphs() == between,
              "graphs " + std::to_string(step.graphs_per_replay()) + ", tasks between " +
                  std::to_string(step.tasks_between_graphs()));
      rt.synchronize();
    });
  }
}

void a_throwing_rank_fails_the_job_without_hanging() {
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::string> errors = braid::try_launch(
      2,
      [](std::size_t rank, braid::Communicator& comm) {
        if (rank == 1) throw std::runtime_error("rank one gives up");
        braid::Runtime rt = rank_runtime(rank);
        braid::Buffer g = rt.alloc("g", 16);
        comm.all_reduce<float>(rt, g).wait();  // rank 1 never joins: fails, does not hang
      },
      milliseconds(20000));
  const auto waited = std::chrono::steady_clock::now() - start;
  CHECK_EQ(errors.size(), static_cast<std::size_t>(2));
  CHECK_CONTAINS(errors[1], "rank one gives up");
  CHECK(!errors[0].empty());
  // Failed through the departure of rank 1, long before the 20 s timeout.
  CHECK(waited < std::chrono::seconds(15));

  const std::string msg = ERROR_OF(braid::launch(3, [](std::size_t rank, braid::Communicator&) {
    if (rank == 2) throw 7;  // not a std::exception
  }));
  CHECK_CONTAINS(msg, "1 of 3 ranks failed");
  CHECK_CONTAINS(msg, "rank 2");
  CHECK_CONTAINS(msg, "not a std::exception");
}

void misuse_of_collectives_throws() {
  braid::launch(2, [](std::size_t rank, braid::Communicator& comm) {
    braid::Runtime rt = rank_runtime(rank);
    braid::Buffer odd = rt.alloc("odd", 6);
    bool threw = false;
    try {
      comm.all_reduce<float>(rt, odd);  // 6 bytes are not whole f32s
    } catch (const braid::Error& e) {
      threw = std::string(e.what()).find("odd") != std::string::npos;
    }
    require(threw, "a misaligned all_reduce throws at submission");
    require(comm.issued() == 0, "a refused collective takes no index");
    threw = false;
    try {
      braid::Buffer v = rt.alloc("v", 16);
      comm.broadcast<float>(rt, v, 5);
    } catch (const braid::Error& e) {
      threw = std::string(e.what()).find("root 5") != std::string::npos;
    }
    require(threw, "a broadcast from a rank outside the group throws");
    require(comm.poisoned().empty(), "not poisoned by refused submissions");
  });
  std::string msg = ERROR_OF(braid::launch(0, [](std::size_t, braid::Communicator&) {}));
  CHECK_CONTAINS(msg, "at least one rank");
  msg = ERROR_OF(braid::launch(2, braid::RankBody()));
  CHECK_CONTAINS(msg, "empty rank function");
}

// Ranks started by the program's own threads, with communicators from a group.
void a_group_with_own_threads() {
  std::vector<braid::Communicator> comms = braid::local_group(3, milliseconds(20000));
  CHECK_EQ(comms.size(), static_cast<std::size_t>(3));
  std::vector<float> results(3, 0.0f);
  std::vector<std::thread> threads;
  std::mutex mu;
  std::vector<std::string> failures;
  for (std::size_t r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      try {
        braid::Runtime rt = rank_runtime(r);
        braid::Buffer v = rt.alloc_from<float>("v", {static_cast<float>(r + 1)});
        comms[r].all_reduce<float>(rt, v);
        results[r] = rt.read_vec<float>(v)[0];
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        failures.push_back(e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK_MSG(failures.empty(), failures.empty() ? "" : failures[0]);
  for (float v : results) CHECK(v == 6.0f);
  const std::string msg = ERROR_OF(braid::local_group(0));
  CHECK_CONTAINS(msg, "at least one rank");
}

// A trace of several ranks: one process per rank.
void one_trace_for_all_ranks() {
  std::mutex mu;
  std::vector<braid::Profile> profiles;
  std::vector<std::uint64_t> marks;
  braid::launch(2, [&](std::size_t rank, braid::Communicator& comm) {
    braid::Runtime rt = rank_runtime(rank);
    braid::Buffer g = rt.alloc("g", 64);
    rt.task("compute").run(braid::write(g), [](auto) { std::this_thread::sleep_for(milliseconds(2)); });
    comm.all_reduce<float>(rt, g);
    rt.synchronize();
    // A second step, cut from the first at a mark taken after it.
    const std::uint64_t mark = braid::now_ns();
    rt.task("compute").run(braid::write(g), [](auto) {});
    rt.synchronize();
    std::lock_guard<std::mutex> lock(mu);
    profiles.push_back(rt.profile());
    marks.push_back(mark);
  });
  CHECK_EQ(profiles.size(), static_cast<std::size_t>(2));
  CHECK(profiles[0].rank() != profiles[1].rank());
  for (std::size_t i = 0; i < profiles.size(); ++i) {
    const braid::Profile& p = profiles[i];
    const braid::Summary s = p.summary();
    CHECK(s.comm_ns > 0);
    CHECK_EQ(p.spans().size(), s.tasks);
    const braid::Profile second = p.since(marks[i]);
    CHECK_EQ(second.spans().size(), static_cast<std::size_t>(1));
    CHECK(second.spans()[0].start_ns >= marks[i]);
    CHECK(second.summary().comm_ns == 0);
    CHECK_EQ(second.rank(), p.rank());
  }
  braid::write_trace("braid-cpp-test-ranks.json", profiles);
}

}  // namespace

int main() {
  check::Runner t;
  t.run("all_collectives_match_by_hand", all_collectives_match_by_hand);
  t.run("collectives_are_ordered_by_their_accesses", collectives_are_ordered_by_their_accesses);
  t.run("ranks_agree_on_a_schedules_placement", ranks_agree_on_a_schedules_placement);
  t.run("a_step_with_its_collective_replays_as_one_graph",
        a_step_with_its_collective_replays_as_one_graph);
  t.run("a_throwing_rank_fails_the_job_without_hanging", a_throwing_rank_fails_the_job_without_hanging);
  t.run("misuse_of_collectives_throws", misuse_of_collectives_throws);
  t.run("a_group_with_own_threads", a_group_with_own_threads);
  t.run("one_trace_for_all_ranks", one_trace_for_all_ranks);
  return t.finish();
}
