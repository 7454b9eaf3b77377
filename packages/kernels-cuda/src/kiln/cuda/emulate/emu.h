// CPU emulation of the CUDA execution model, enough for kiln's SIMT kernels: the same .cu source is
// compiled by g++ with this header in front. Each CUDA thread of a block is a fiber (ucontext) on one OS
// thread; blocks run one after another, so `__shared__` (a function-static here) is the block's own.
// A fiber runs until __syncthreads (all live threads of the block must arrive) or a warp shuffle (all live
// threads of its warp must arrive), in thread order: a missing barrier reads what other threads have not
// written yet, and a barrier that cannot be reached by every thread is reported as a deadlock.
#pragma once
#define KILN_EMULATOR 1  // kernels leave out what only a GPU runs (tensor-core instructions)
#include <math.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <ucontext.h>
#include <utility>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

namespace emu {

enum State { RUNNING, AT_BLOCK_BARRIER, AT_WARP_BARRIER, DONE };

struct Fiber {
    ucontext_t ctx;
    dim3 idx;
    unsigned linear = 0;
    State state = DONE;
    std::vector<char> stack;
};

constexpr unsigned MAX_THREADS = 1024;
constexpr size_t STACK_BYTES = 128 * 1024;

inline std::vector<Fiber> fibers;
inline Fiber* current = nullptr;
inline ucontext_t scheduler;
inline dim3 block_idx, block_dim, grid_dim;
inline void (*body)(void*) = nullptr;
inline void* body_arg = nullptr;
inline uint64_t exchange[MAX_THREADS];

inline void wait(State s) {
    current->state = s;
    swapcontext(&current->ctx, &scheduler);
}

inline void entry() {
    body(body_arg);
    current->state = DONE;  // then uc_link resumes the scheduler
}

// Runs every thread of one block to completion; 1 on a deadlock.
inline int run_block(unsigned n) {
    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = fibers[i];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = &scheduler;
        makecontext(&f.ctx, entry, 0);
        f.idx = {i % block_dim.x, (i / block_dim.x) % block_dim.y, i / (block_dim.x * block_dim.y)};
        f.linear = i;
        f.state = RUNNING;
    }
    for (;;) {
        for (unsigned i = 0; i < n; ++i) {
            if (fibers[i].state != RUNNING) continue;
            current = &fibers[i];
            swapcontext(&scheduler, &fibers[i].ctx);
        }
        bool released = false, all_done = true, all_at_block = true;
        for (unsigned w = 0; w < n; w += 32) {
            unsigned end = std::min(w + 32, n);
            bool all_at_warp = true, any = false;
            for (unsigned i = w; i < end; ++i) {
                if (fibers[i].state == DONE) continue;
                any = true;
                all_at_warp &= fibers[i].state == AT_WARP_BARRIER;
            }
            if (any && all_at_warp) {
                for (unsigned i = w; i < end; ++i)
                    if (fibers[i].state == AT_WARP_BARRIER) fibers[i].state = RUNNING;
                released = true;
            }
        }
        for (unsigned i = 0; i < n; ++i) {
            if (fibers[i].state == DONE) continue;
            all_done = false;
            all_at_block &= fibers[i].state == AT_BLOCK_BARRIER;
        }
        if (all_done) return 0;
        if (!released && all_at_block) {
            for (unsigned i = 0; i < n; ++i)
                if (fibers[i].state == AT_BLOCK_BARRIER) fibers[i].state = RUNNING;
            released = true;
        }
        if (!released) return 1;
    }
}

template <class... A, size_t... I>
void call(void (*k)(A...), void** args, std::index_sequence<I...>) {
    k(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

// Launches kernel k on geom = {grid x, y, z, block x, y, z} with cuLaunchKernel-style args (one pointer per
// parameter); 0 when it ran, 1 on a deadlock, 2 on a bad block size.
template <class... A>
int run(void (*k)(A...), const unsigned* geom, void** args) {
    grid_dim = {geom[0], geom[1], geom[2]};
    block_dim = {geom[3], geom[4], geom[5]};
    unsigned n = geom[3] * geom[4] * geom[5];
    if (n == 0 || n > MAX_THREADS) return 2;
    if (fibers.size() < n) {
        fibers.resize(n);
        for (auto& f : fibers)
            if (f.stack.empty()) f.stack.resize(STACK_BYTES);
    }
    struct Call {
        void (*k)(A...);
        void** args;
    } c{k, args};
    body = [](void* p) {
        auto* c = static_cast<Call*>(p);
        call(c->k, c->args, std::index_sequence_for<A...>{});
    };
    body_arg = &c;
    for (unsigned z = 0; z < grid_dim.z; ++z)
        for (unsigned y = 0; y < grid_dim.y; ++y)
            for (unsigned x = 0; x < grid_dim.x; ++x) {
                block_idx = {x, y, z};
                if (run_block(n)) return 1;
            }
    return 0;
}

// The size of each parameter of k, as the compiler lays it out for a call.
template <class... A>
void sizes(void (*)(A...), int* out) {
    int i = 0;
    ((out[i++] = (int)sizeof(A)), ...);
}

}  // namespace emu

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define threadIdx (emu::current->idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
constexpr int warpSize = 32;
using std::max;
using std::min;

inline void __syncthreads() { emu::wait(emu::AT_BLOCK_BARRIER); }

namespace emu {
// A warp shuffle: every live lane of the warp publishes v, then reads lane `source(own lane)`'s.
template <class T, class F>
T shuffle(T v, F source) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "shuffles move at most 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    exchange[current->linear] = bits;
    wait(AT_WARP_BARRIER);
    bits = exchange[(current->linear & ~31u) | (source(current->linear % 32) & 31u)];
    wait(AT_WARP_BARRIER);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}
}  // namespace emu

template <class T>
T __shfl_xor_sync(unsigned, T v, int lane_mask) {
    return emu::shuffle(v, [=](unsigned lane) { return lane ^ (unsigned)lane_mask; });
}

template <class T>
T __shfl_sync(unsigned, T v, int src_lane) {
    return emu::shuffle(v, [=](unsigned) { return (unsigned)src_lane; });
}

inline unsigned __float_as_uint(float x) {
    unsigned u;
    std::memcpy(&u, &x, 4);
    return u;
}

inline float __uint_as_float(unsigned u) {
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}
