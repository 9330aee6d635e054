// emu.cpp: the emulator's runtime (cuda_emu.h): blocks one after another,
// a fiber per thread (ucontext), a cooperative round-robin scheduler, block
// and warp barriers, and the warp-collective operations built on them.
//
// Scheduling: a pass resumes the runnable fibers in thread order, each until
// it waits at a barrier or returns; a fiber that stops switches straight to
// the next runnable one after it, and the last back to the scheduler, which
// starts another pass while any fiber is runnable. None runnable and not all
// returned is a deadlock. A reversed launch (emu_launch's `reverse`) takes
// the blocks and, within a pass, the threads in the opposite order: a kernel
// free of races between threads and between blocks gives the same bits
// either way (what src/launch.rs checks).
//
// A warp-collective operation (shuffle, vote, MMA) is one warp barrier: every
// lane deposits its operands in the warp's exchange buffer, waits, and reads
// what it needs. The buffers alternate between consecutive operations, so no
// second barrier is needed before a lane's next deposit: a lane can be at
// most one operation ahead of the slowest, whose buffer it does not touch.
#include "cuda_emu.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace braid_emu {

namespace detail {
const Thread* current = nullptr;
Grid grid;
}  // namespace detail

namespace {

constexpr size_t kStackBytes = 256 * 1024;

enum class State : unsigned char { Runnable, AtSyncthreads, AtWarpBarrier, Exited };

struct Fiber {
    Thread t;
    State state;
    unsigned parity;     // which exchange buffer the lane's next collective uses
    const char* op;      // the warp-collective operation it waits at
    ucontext_t ctx;      // never copied or moved once getcontext has filled it
};

// The exchange buffers of a warp's collectives, two of them (above).
struct Exchange {
    unsigned word[32];                     // shuffles and votes
    unsigned mma_a[32][4], mma_b[32][2];   // MMA fragments
    const void* row[32];                   // ldmatrix row addresses
};

struct Warp {
    unsigned lanes;    // threads in the warp: 32, fewer in a partial last warp
    unsigned arrived;  // lanes waiting at the warp barrier
    Exchange x[2];
};

// The state of the launch in progress (launch_mutex held).
struct Runtime {
    std::vector<char*> stacks;  // kStackBytes each above a guard page, reused
    std::vector<Fiber> fibers;  // the block's threads, by linear id
    std::vector<Warp> warps;
    unsigned block_arrived = 0;  // threads waiting at __syncthreads
    ucontext_t scheduler;
    Fiber* running = nullptr;
    void (*fn)(void*) = nullptr;
    void* arg = nullptr;
    std::string error;  // set by fail(): ends the launch
    bool reverse = false;  // blocks and threads in the opposite order
};

Runtime rt;
std::mutex launch_mutex;
thread_local std::string last_error_msg;
thread_local bool in_launch = false;
thread_local bool reverse_next = false;  // emu_launch's `reverse`, for launch_raw

std::string format(const char* fmt, va_list ap) {
    char buf[1024];
    vsnprintf(buf, sizeof buf, fmt, ap);
    return buf;
}

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::string s = format(fmt, ap);
    va_end(ap);
    return s;
}

// The k-th fiber of a pass; also the place of fiber k in a pass, since
// either order is its own inverse.
size_t order_at(size_t k) { return rt.reverse ? rt.fibers.size() - 1 - k : k; }

// Leaves `f` (waiting, or exited: then for good) for the next runnable
// fiber after it, or the scheduler at the end of the pass; returns when `f`
// is resumed.
void yield(Fiber* f) {
    ucontext_t* to = &rt.scheduler;
    rt.running = nullptr;
    const size_t n = rt.fibers.size();
    for (size_t k = order_at(f->t.linear) + 1; k < n; k++) {
        Fiber& g = rt.fibers[order_at(k)];
        if (g.state == State::Runnable) {
            rt.running = &g;
            detail::current = &g.t;
            to = &g.ctx;
            break;
        }
    }
    if (f->state == State::Exited)
        setcontext(to);
    else
        swapcontext(&f->ctx, to);
}

Fiber* self(const char* who) {
    if (rt.running == nullptr) {
        fprintf(stderr, "braid_emu: %s called outside a kernel launch\n", who);
        abort();
    }
    return rt.running;
}

Warp& warp_of(Fiber* f) { return rt.warps[f->t.warp]; }

unsigned lanes_mask(unsigned lanes) { return lanes == 32 ? 0xffffffffu : (1u << lanes) - 1; }

void check_full_mask(Fiber* f, unsigned mask, const char* who) {
    const unsigned lanes = warp_of(f).lanes;
    if (mask != 0xffffffffu && mask != lanes_mask(lanes))
        fail("%s: mask 0x%08x: only the full warp (0xffffffff) is supported", who, mask);
}

// Waits until every lane of the calling fiber's warp is at a warp barrier,
// all of them at the same operation `op`.
void warp_barrier(Fiber* f, const char* op) {
    Warp& w = warp_of(f);
    f->state = State::AtWarpBarrier;
    f->op = op;
    if (++w.arrived == w.lanes) {
        w.arrived = 0;
        Fiber* lane0 = &rt.fibers[size_t(f->t.warp) * 32];
        for (Fiber* g = lane0; g < lane0 + w.lanes; g++) {
            if (std::strcmp(g->op, op) != 0)
                fail("lanes of warp %u at different warp-collective operations: lane %u at %s, "
                     "lane %u at %s",
                     f->t.warp, g->t.lane, g->op, f->t.lane, op);
            g->state = State::Runnable;
        }
        return;  // the last to arrive goes on
    }
    yield(f);
}

// The exchange buffer of the calling lane's next collective.
Exchange& exchange(Fiber* f) {
    Exchange& x = warp_of(f).x[f->parity];
    f->parity ^= 1;
    return x;
}

void fiber_entry() {
    bool threw = false;
    try {
        rt.fn(rt.arg);
    } catch (...) {
        threw = true;
    }
    if (threw) fail("a C++ exception escaped the kernel");
    rt.running->state = State::Exited;
    yield(rt.running);  // never returns
}

bool ensure_stacks(size_t n) {
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    while (rt.stacks.size() < n) {
        void* p = mmap(nullptr, page + kStackBytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) return false;
        mprotect(p, page, PROT_NONE);  // overflowing a stack faults, not corrupts
        rt.stacks.push_back(static_cast<char*>(p) + page);
    }
    return true;
}

// Why the fibers of the block still alive cannot go on.
std::string deadlock_report() {
    unsigned at_sync = 0, at_warp = 0, exited = 0;
    for (const Fiber& f : rt.fibers) {
        at_sync += f.state == State::AtSyncthreads;
        at_warp += f.state == State::AtWarpBarrier;
        exited += f.state == State::Exited;
    }
    std::string s = format(
        "deadlock in block (%u,%u,%u): of %zu threads, %u wait at __syncthreads, %u at a "
        "warp barrier (__syncwarp, a shuffle, a vote or an MMA), %u have returned",
        detail::grid.block_idx.x, detail::grid.block_idx.y, detail::grid.block_idx.z,
        rt.fibers.size(), at_sync, at_warp, exited);
    for (size_t w = 0; w < rt.warps.size(); w++) {
        if (rt.warps[w].arrived != 0) {
            s += format("; warp %zu: %u of %u lanes at the warp barrier", w, rt.warps[w].arrived,
                        rt.warps[w].lanes);
            break;
        }
    }
    return s + " (__syncthreads needs every thread of the block, a warp-collective operation "
               "every lane of the warp)";
}

// Runs the block detail::grid.block_idx to completion; false on an error.
bool run_block() {
    for (Fiber& f : rt.fibers) {
        f.state = State::Runnable;
        f.parity = 0;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = rt.stacks[f.t.linear];
        f.ctx.uc_stack.ss_size = kStackBytes;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, fiber_entry, 0);
    }
    for (Warp& w : rt.warps) w.arrived = 0;
    rt.block_arrived = 0;
    for (;;) {  // a pass
        Fiber* first = nullptr;
        for (size_t k = 0; k < rt.fibers.size(); k++) {
            Fiber& f = rt.fibers[order_at(k)];
            if (f.state == State::Runnable) {
                first = &f;
                break;
            }
        }
        if (first == nullptr) break;
        rt.running = first;
        detail::current = &first->t;
        swapcontext(&rt.scheduler, &first->ctx);
        if (!rt.error.empty()) return false;
    }
    for (const Fiber& f : rt.fibers) {
        if (f.state != State::Exited) {
            rt.error = deadlock_report();
            return false;
        }
    }
    return true;
}

bool check_config(dim3 grid, dim3 block) {
    const unsigned long long threads = 1ull * block.x * block.y * block.z;
    if (block.x == 0 || block.y == 0 || block.z == 0 || block.x > 1024 || block.y > 1024 ||
        block.z > 64 || threads > 1024) {
        rt.error = format("invalid block (%u,%u,%u): each dimension >= 1, x, y <= 1024, "
                          "z <= 64, at most 1024 threads",
                          block.x, block.y, block.z);
        return false;
    }
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
        grid.z > 65535) {
        rt.error = format("invalid grid (%u,%u,%u): each dimension >= 1, x < 2^31, "
                          "y, z <= 65535",
                          grid.x, grid.y, grid.z);
        return false;
    }
    return true;
}

bool run_grid(dim3 grid, dim3 block) {
    if (!check_config(grid, block)) return false;
    const unsigned n = block.x * block.y * block.z;
    if (!ensure_stacks(n)) {
        rt.error = format("cannot map %u fiber stacks", n);
        return false;
    }
    rt.fibers = std::vector<Fiber>(n);  // before any getcontext: contexts never move
    rt.warps = std::vector<Warp>((n + 31) / 32);
    for (unsigned i = 0; i < n; i++) {
        Thread& t = rt.fibers[i].t;
        t.thread_idx = {i % block.x, i / block.x % block.y, i / (block.x * block.y)};
        t.linear = i;
        t.warp = i / 32;
        t.lane = i % 32;
    }
    for (size_t w = 0; w < rt.warps.size(); w++)
        rt.warps[w].lanes = unsigned(std::min<size_t>(32, n - w * 32));
    detail::grid.block_dim = block;
    detail::grid.grid_dim = grid;
    const unsigned long long blocks = 1ull * grid.x * grid.y * grid.z;
    for (unsigned long long k = 0; k < blocks; k++) {
        const unsigned long long i = rt.reverse ? blocks - 1 - k : k;  // x fastest
        detail::grid.block_idx = {unsigned(i % grid.x), unsigned(i / grid.x % grid.y),
                                  unsigned(i / (1ull * grid.x * grid.y))};
        if (!run_block()) return false;
    }
    return true;
}

}  // namespace

void fail(const char* fmt, ...) {
    Fiber* f = self("fail");
    va_list ap;
    va_start(ap, fmt);
    const std::string msg = format(fmt, ap);
    va_end(ap);
    const uint3 b = detail::grid.block_idx, t = f->t.thread_idx;
    rt.error = format("block (%u,%u,%u) thread (%u,%u,%u): %s", b.x, b.y, b.z, t.x, t.y, t.z,
                      msg.c_str());
    f->state = State::Exited;
    setcontext(&rt.scheduler);  // the launch ends; this fiber is never resumed
    abort();
}

void sync_block() {
    Fiber* f = self("__syncthreads");
    f->state = State::AtSyncthreads;
    if (++rt.block_arrived == rt.fibers.size()) {
        rt.block_arrived = 0;
        for (Fiber& g : rt.fibers) g.state = State::Runnable;
        return;  // the last to arrive goes on
    }
    yield(f);
}

void sync_warp(unsigned mask, const char* who) {
    Fiber* f = self(who);
    check_full_mask(f, mask, who);
    warp_barrier(f, who);
}

// PTX shfl.sync: the source lane j of `mode` with c = ((32 - width) << 8) |
// (mode == Up ? 0 : 31), as CUDA's __shfl*_sync pass it; out of range, the
// caller's own value.
unsigned shfl_word(unsigned mask, unsigned v, Shfl mode, unsigned b, int width, const char* who) {
    Fiber* f = self(who);
    check_full_mask(f, mask, who);
    if (width < 1 || width > 32 || (width & (width - 1)) != 0)
        fail("%s: width %d is not a power of two in 1..32", who, width);
    Warp& w = warp_of(f);
    const int lane = int(f->t.lane), bval = int(b & 31), segmask = 32 - width;
    const int clamp = mode == Shfl::Up ? 0 : 31;
    const int max_lane = (lane & segmask) | (clamp & ~segmask), min_lane = lane & segmask;
    int j = lane;
    bool ok = true;
    switch (mode) {
        case Shfl::Up: j = lane - bval; ok = j >= max_lane; break;
        case Shfl::Down: j = lane + bval; ok = j <= max_lane; break;
        case Shfl::Bfly: j = lane ^ bval; ok = j <= max_lane; break;
        case Shfl::Idx: j = min_lane | (bval & ~segmask); ok = j <= max_lane; break;
    }
    if (!ok) j = lane;
    Exchange& x = exchange(f);
    x.word[lane] = v;
    warp_barrier(f, who);
    if (unsigned(j) >= w.lanes)
        fail("%s: lane %d reads lane %d, which does not exist (a warp of %u threads)", who, lane,
             j, w.lanes);
    return x.word[j];
}

unsigned ballot(unsigned mask, int pred, const char* who) {
    Fiber* f = self(who);
    check_full_mask(f, mask, who);
    Exchange& x = exchange(f);
    x.word[f->t.lane] = pred != 0;
    warp_barrier(f, who);
    unsigned r = 0;
    for (unsigned i = 0; i < warp_of(f).lanes; i++) r |= x.word[i] << i;
    return r;
}

void mma_bf16_16816(float d[4], const unsigned a[4], const unsigned b[2]) {
    Fiber* f = self("mma_bf16_16816");
    Warp& w = warp_of(f);
    if (w.lanes != 32) fail("mma_bf16_16816: needs a full warp, this one has %u threads", w.lanes);
    const unsigned lane = f->t.lane;
    Exchange& x = exchange(f);
    std::memcpy(x.mma_a[lane], a, sizeof x.mma_a[lane]);
    std::memcpy(x.mma_b[lane], b, sizeof x.mma_b[lane]);
    warp_barrier(f, "mma_bf16_16816");
    // The bf16 in the low (even index) or high (odd) half of a register.
    const auto bf16 = [](unsigned reg, unsigned odd) {
        return __uint_as_float((odd ? reg >> 16 : reg & 0xffffu) << 16);
    };
    const auto A = [&](unsigned r, unsigned c) {
        return bf16(x.mma_a[(r % 8) * 4 + (c % 8) / 2][(r >= 8) + 2 * (c >= 8)], c & 1);
    };
    const auto B = [&](unsigned k, unsigned n) {
        return bf16(x.mma_b[n * 4 + (k % 8) / 2][k >= 8], k & 1);
    };
    const unsigned g = lane >> 2, t = lane % 4;
    for (unsigned i = 0; i < 4; i++) {
        const unsigned r = g + 8 * (i / 2), c = 2 * t + i % 2;
        float acc = d[i];
        for (unsigned k = 0; k < 16; k++) acc = acc + A(r, k) * B(k, c);
        d[i] = acc;
    }
}

// ldmatrix .m8n8 .x4 .b16, `trans` or not (cuda_emu.h).
void ldmatrix_x4_any(unsigned r[4], const void* row, bool trans, const char* who) {
    Fiber* f = self(who);
    Warp& w = warp_of(f);
    if (w.lanes != 32) fail("%s: needs a full warp, this one has %u threads", who, w.lanes);
    if (reinterpret_cast<uintptr_t>(row) % 16 != 0)
        fail("%s: row address %p is not 16-byte aligned", who, row);
    const unsigned lane = f->t.lane;
    Exchange& x = exchange(f);
    x.row[lane] = row;
    warp_barrier(f, who);
    // Element (row, col) of matrix i: row `row` of it starts at lane 8i + row.
    const auto at = [&](unsigned i, unsigned rw, unsigned col) {
        unsigned short v;
        std::memcpy(&v, static_cast<const char*>(x.row[8 * i + rw]) + 2 * col, 2);
        return unsigned(v);
    };
    const unsigned g = lane >> 2, t = lane % 4;
    for (unsigned i = 0; i < 4; i++)
        r[i] = trans ? at(i, 2 * t, g) | (at(i, 2 * t + 1, g) << 16)
                     : at(i, g, 2 * t) | (at(i, g, 2 * t + 1) << 16);
}

void ldmatrix_x4_trans(unsigned r[4], const void* row) {
    ldmatrix_x4_any(r, row, true, "ldmatrix_x4_trans");
}

void ldmatrix_x4(unsigned r[4], const void* row) { ldmatrix_x4_any(r, row, false, "ldmatrix_x4"); }

int launch_raw(dim3 grid, dim3 block, void (*fn)(void*), void* arg) {
    if (in_launch) {
        last_error_msg = "launch from inside a kernel (dynamic parallelism) is not supported";
        return 1;
    }
    std::lock_guard<std::mutex> lock(launch_mutex);
    in_launch = true;
    rt.fn = fn;
    rt.arg = arg;
    rt.error.clear();
    rt.reverse = reverse_next;
    const bool ok = run_grid(grid, block);
    rt.running = nullptr;
    detail::current = nullptr;
    in_launch = false;
    last_error_msg = ok ? "" : rt.error;
    return ok ? 0 : 1;
}

const char* last_error() { return last_error_msg.c_str(); }

// ---------------------------------------------------------------------------
// The exported kernels (BRAID_EMU_EXPORT), by name
// ---------------------------------------------------------------------------

namespace {

struct Exported {
    std::string param_types;
    int arity;
    PackedLaunch launch;
    int exports;  // more than 1: two files export the name, and it is refused
};

// Filled by the static initialisers of the kernels_*.cpp files, hence a
// function-local static (initialised on first use, whatever the order).
std::map<std::string, Exported>& registry() {
    static std::map<std::string, Exported> r;
    return r;
}

}  // namespace

bool register_kernel(const char* name, std::string param_types, int arity, PackedLaunch launch) {
    auto it = registry().try_emplace(name, Exported{std::move(param_types), arity, launch, 0}).first;
    it->second.exports++;
    return true;
}

}  // namespace braid_emu

extern "C" int emu_launch(const char* kernel, const char* param_types, int nargs,
                          const void* const* args, unsigned gx, unsigned gy, unsigned gz,
                          unsigned bx, unsigned by, unsigned bz, int reverse) {
    using namespace braid_emu;
    const auto it = registry().find(kernel);
    if (it == registry().end()) {
        last_error_msg = "no kernel of this name is exported (BRAID_EMU_EXPORT in csrc/)";
        return 1;
    }
    const Exported& k = it->second;
    if (k.exports != 1) {
        last_error_msg = "exported " + std::to_string(k.exports) + " times (BRAID_EMU_EXPORT)";
        return 1;
    }
    // The kernel's launcher reads args[0 .. k.arity), each as the type its
    // parameter list names: both must be the caller's.
    if (nargs != k.arity || param_types != k.param_types) {
        last_error_msg = "called with " + std::to_string(nargs) + " arguments (" + param_types +
                         "), but the kernel's parameters are (" + k.param_types + ")";
        return 1;
    }
    reverse_next = reverse != 0;
    const int rc = k.launch(dim3(gx, gy, gz), dim3(bx, by, bz), args);
    reverse_next = false;
    return rc;
}

extern "C" const char* emu_last_error() { return braid_emu::last_error(); }
