// Peers of Braid's dag_overhead benchmark (benches/src/bin/dag_overhead.rs):
// the same task-graph shapes of N empty tasks, run by
//
//   openmp    OpenMP tasks with depend(in/out/inout) on per-buffer dummy
//             variables: the runtime (libgomp) infers the dependencies at
//             submission, as Braid does;
//   tbb-flow  a oneTBB flow::graph of continue_nodes, built by hand for the
//             shape: a static graph, timed built and run (construction,
//             try_put, wait_for_all) and run only (a second run of the same
//             graph).
//
// Prints one key=value line per peer, shape and mode, with the median and the
// best of --runs runs in ns per task, like dag_overhead. Build and run it, with
// dag_overhead beside it, through scripts/peer-bench.sh.

#include <omp.h>
#include <tbb/flow_graph.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

namespace {

// xoshiro256++ seeded through SplitMix64, as rand's
// Xoshiro256PlusPlus::seed_from_u64: the generator behind braid_gpt2's Rng,
// so the random shape draws the same buffers as dag_overhead.
class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (uint64_t& w : s_) {
      seed += 0x9e3779b97f4a7c15;
      uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9;
      z = (z ^ (z >> 27)) * 0x94d049bb133111eb;
      w = z ^ (z >> 31);
    }
  }

  uint64_t next() {
    const uint64_t r = rotl(s_[0] + s_[3], 23) + s_[0];
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return r;
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

enum class Shape { Chain, Fanout, Random };

const char* shape_name(Shape s) {
  switch (s) {
    case Shape::Chain: return "chain";
    case Shape::Fanout: return "fanout";
    case Shape::Random: return "random";
  }
  return "?";
}

// random: the buffers in dag_overhead's pool, and the width of the layered
// graph of tbb-flow.
constexpr uint64_t kPool = 64;
// random, tbb-flow: edges into each task from the previous layer.
constexpr int kEdges = 3;

// An empty task body the compiler cannot drop.
inline void empty_body() { asm volatile("" ::: "memory"); }

using Clock = std::chrono::steady_clock;

double ns_per_task(Clock::time_point t0, Clock::time_point t1, size_t tasks) {
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / double(tasks);
}

// --- openmp ------------------------------------------------------------------

// Submits `tasks` empty tasks of `shape` from one thread of a team of
// `threads`; the region's closing barrier waits for all of them. `b` holds one
// dummy byte per buffer of the shape: its address is what `depend` names
// (maybe_unused: GCC does not count a use in a depend clause).
void openmp_run(Shape shape, size_t tasks, int threads, [[maybe_unused]] char* b) {
#pragma omp parallel num_threads(threads)
#pragma omp single
  {
    switch (shape) {
      case Shape::Chain:
        for (size_t i = 0; i < tasks; ++i) {
#pragma omp task depend(inout : b[0])
          empty_body();
        }
        break;
      case Shape::Fanout:
#pragma omp task depend(out : b[0])
        empty_body();
        for (size_t i = 1; i < tasks; ++i) {
#pragma omp task depend(in : b[0]) depend(out : b[i])
          empty_body();
        }
        break;
      case Shape::Random: {
        Rng rng(0);
        for (size_t i = 0; i < tasks; ++i) {
          const uint64_t x = rng.next() % kPool, y = rng.next() % kPool, z = rng.next() % kPool;
          // Writes z, reads x and y where they differ from z and each other.
          uint64_t r[2];
          int n = 0;
          if (x != z) r[n++] = x;
          if (y != z && y != x) r[n++] = y;
          if (n == 0) {
#pragma omp task depend(out : b[z])
            empty_body();
          } else if (n == 1) {
#pragma omp task depend(out : b[z]) depend(in : b[r[0]])
            empty_body();
          } else {
#pragma omp task depend(out : b[z]) depend(in : b[r[0]], b[r[1]])
            empty_body();
          }
        }
        break;
      }
    }
  }
}

// --- tbb-flow ----------------------------------------------------------------

using Msg = tbb::flow::continue_msg;
using Node = tbb::flow::continue_node<Msg>;

// The shape as a static flow graph: chain, one root with tasks-1 successors,
// or layers of kPool nodes, each after kEdges distinct nodes of the previous
// layer drawn with a fixed seed.
class FlowGraph {
 public:
  FlowGraph(Shape shape, size_t tasks) {
    auto body = [](const Msg&) {
      empty_body();
      return Msg();
    };
    Rng rng(0);
    for (size_t i = 0; i < tasks; ++i) {
      Node& node = nodes_.emplace_back(g_, body);
      switch (shape) {
        case Shape::Chain:
          if (i > 0) tbb::flow::make_edge(nodes_[i - 1], node);
          break;
        case Shape::Fanout:
          if (i > 0) tbb::flow::make_edge(nodes_[0], node);
          break;
        case Shape::Random:
          if (i >= kPool) {
            const size_t layer = i - i % kPool - kPool;
            uint64_t pick[kEdges];
            for (int e = 0; e < kEdges; ++e) {
              do pick[e] = rng.next() % kPool;
              while (std::find(pick, pick + e, pick[e]) != pick + e);
              tbb::flow::make_edge(nodes_[layer + pick[e]], node);
            }
          }
          break;
      }
      if (i == 0 || (shape == Shape::Random && i < kPool)) roots_.push_back(&node);
    }
  }

  void run() {
    for (Node* root : roots_) root->try_put(Msg());
    g_.wait_for_all();
  }

 private:
  tbb::flow::graph g_;  // declared first: destroyed after its nodes
  std::deque<Node> nodes_;
  std::vector<Node*> roots_;
};

// --- driver ------------------------------------------------------------------

struct Args {
  std::vector<Shape> shapes{Shape::Chain, Shape::Fanout, Shape::Random};
  std::string peer = "all";
  size_t tasks = 100000;
  int runs = 5;
  int threads = 2;
};

[[noreturn]] void usage(int code) {
  std::fprintf(code ? stderr : stdout,
               "usage: dag_peers [--shape chain|fanout|random|all] [--tasks N] [--runs R]\n"
               "                 [--threads T] [--peer openmp|tbb-flow|all]\n"
               "Times N empty tasks of each shape under OpenMP tasks with depend and a\n"
               "oneTBB flow graph, on T threads; prints the median and best ns per task\n"
               "(defaults: all shapes, N=100000, R=5, T=2, all peers).\n");
  std::exit(code);
}

long parse_count(const char* flag, const char* s) {
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  if (*s == '\0' || *end != '\0' || v < 1) {
    std::fprintf(stderr, "dag_peers: %s wants a positive integer, not `%s`\n", flag, s);
    usage(2);
  }
  return v;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") usage(0);
    if (i + 1 == argc) {
      std::fprintf(stderr, "dag_peers: %s wants a value\n", flag.c_str());
      usage(2);
    }
    const char* v = argv[++i];
    if (flag == "--shape") {
      const std::string s = v;
      if (s == "chain") a.shapes = {Shape::Chain};
      else if (s == "fanout") a.shapes = {Shape::Fanout};
      else if (s == "random") a.shapes = {Shape::Random};
      else if (s != "all") {
        std::fprintf(stderr, "dag_peers: unknown shape `%s`\n", v);
        usage(2);
      }
    } else if (flag == "--peer") {
      a.peer = v;
      if (a.peer != "openmp" && a.peer != "tbb-flow" && a.peer != "all") {
        std::fprintf(stderr, "dag_peers: unknown peer `%s`\n", v);
        usage(2);
      }
    } else if (flag == "--tasks") {
      a.tasks = size_t(parse_count("--tasks", v));
    } else if (flag == "--runs") {
      a.runs = int(parse_count("--runs", v));
    } else if (flag == "--threads") {
      a.threads = int(parse_count("--threads", v));
    } else {
      std::fprintf(stderr, "dag_peers: unknown flag %s\n", flag.c_str());
      usage(2);
    }
  }
  return a;
}

void report(const char* peer, Shape shape, const Args& a, const char* mode, std::vector<double> ns) {
  std::sort(ns.begin(), ns.end());
  std::printf("peer=%s shape=%s tasks=%zu threads=%d mode=%s ns_per_task=%.1f best_ns_per_task=%.1f\n",
              peer, shape_name(shape), a.tasks, a.threads, mode, ns[ns.size() / 2], ns[0]);
  std::fflush(stdout);
}

void bench_openmp(Shape shape, const Args& a) {
  // One dummy byte per buffer, allocated up front as dag_overhead does.
  std::vector<char> b(shape == Shape::Fanout ? a.tasks : shape == Shape::Random ? kPool : 1);
  openmp_run(shape, std::min<size_t>(a.tasks, 10000), a.threads, b.data());  // warm-up
  std::vector<double> ns;
  for (int r = 0; r < a.runs; ++r) {
    const auto t0 = Clock::now();
    openmp_run(shape, a.tasks, a.threads, b.data());
    ns.push_back(ns_per_task(t0, Clock::now(), a.tasks));
  }
  report("openmp", shape, a, "inferred", ns);
}

void bench_tbb_flow(Shape shape, const Args& a) {
  tbb::task_arena arena(a.threads);  // the calling thread and threads-1 workers
  std::vector<double> built, rerun;
  arena.execute([&] {
    FlowGraph(shape, std::min<size_t>(a.tasks, 10000)).run();  // warm-up
    for (int r = 0; r < a.runs; ++r) {
      const auto t0 = Clock::now();
      FlowGraph g(shape, a.tasks);
      g.run();
      const auto t1 = Clock::now();
      g.run();
      const auto t2 = Clock::now();
      built.push_back(ns_per_task(t0, t1, a.tasks));
      rerun.push_back(ns_per_task(t1, t2, a.tasks));
    }  // the graph's destruction is not timed
  });
  report("tbb-flow", shape, a, "built_and_run", built);
  report("tbb-flow", shape, a, "run_only", rerun);
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  omp_set_dynamic(0);
  for (Shape shape : a.shapes) {
    if (a.peer != "tbb-flow") bench_openmp(shape, a);
    if (a.peer != "openmp") bench_tbb_flow(shape, a);
  }
  return 0;
}
