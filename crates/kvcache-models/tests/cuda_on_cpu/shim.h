// Just enough of CUDA's kernel language to run a kernel written without warp
// intrinsics on the CPU: each block's threads are CPU threads, `__shared__`
// variables are shared by them (blocks run one at a time), `__syncthreads` is
// a barrier. For tests only: it is slow and proves the kernel's logic, not
// its speed or its behaviour under the GPU's memory model.
#pragma once

#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x = 0, y = 0, z = 0;
};

inline dim3 blockIdx, blockDim, gridDim;
inline thread_local dim3 threadIdx;
inline std::barrier<>* shim_block_barrier = nullptr;

inline void __syncthreads() { shim_block_barrier->arrive_and_wait(); }

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

// Runs `kernel` (called once per thread) over a grid of `grid` blocks of
// `threads` threads, one block at a time, the block's threads on a pool of CPU
// threads kept for the whole launch.
inline void shim_launch(dim3 grid, unsigned threads, const std::function<void()>& kernel) {
    gridDim = grid;
    blockDim = dim3{threads, 1, 1};
    std::barrier<> block(threads);
    std::barrier<> gate(threads + 1);
    shim_block_barrier = &block;
    bool done = false;
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; t++) {
        pool.emplace_back([&, t] {
            threadIdx = dim3{t, 0, 0};
            for (;;) {
                gate.arrive_and_wait();  // a block is set up, or the launch is over
                if (done) return;
                kernel();
                gate.arrive_and_wait();  // the block is finished
            }
        });
    }
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                blockIdx = dim3{x, y, z};
                gate.arrive_and_wait();
                gate.arrive_and_wait();
            }
    done = true;
    gate.arrive_and_wait();
    for (auto& th : pool) th.join();
}
