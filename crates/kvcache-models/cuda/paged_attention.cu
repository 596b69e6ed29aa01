// Paged attention on CUDA: each query row attends to exactly the cells its
// runs name, reading keys and values in their stored type (f32, f16, bf16, or
// q8_0 integers with one f16 scale per 32 values of a head).
//
// One thread block per (query row, key/value head), `PA_THREADS` threads. The
// block walks the row's visible cells in tiles of `PA_THREADS` cells:
//   1. thread t finds the tile's cell t in the row's runs (a binary search
//      over the runs' running counts) and scores it against the row's `group`
//      query heads that share this key/value head;
//   2. the block reduces the tile's maximum per head, turns scores into
//      probabilities under the running maximum and reduces their sum; the
//      running sums are rescaled as the maximum grows (online softmax);
//   3. each thread owns an output dimension of every head of the group and
//      adds tile cells' values times their probabilities, so consecutive
//      threads read consecutive values of a cell; a head shorter than the
//      block has several threads per dimension, each taking every few cells,
//      their sums added at the end.
// A row that sees no cell gets zeros.
//
// Inputs (see `kvcache_engine::attention::device`, which builds them):
//   q      f32 [rows, n_heads, head_dim], contiguous; query head j * group + i
//          uses key/value head j.
//   k, v   stored elements; element (cell, head, d) at
//          start + cell * cell_stride + head * head_stride + d * dim_stride
//          (values in the permuted layout are the same with other strides).
//   ks, vs q8_0 scales (f16 bits), element (cell, head, d / 32) through the
//          scale strides; unused for float storage.
//   runs   u32: offsets[rows + 1] | visible[rows] | starts[runs] | before[runs]
//          (row r's runs are offsets[r]..offsets[r + 1]; run i starts at cell
//          starts[i], and before[i] cells of its row come before it).
//   out    f32 [rows, n_heads * head_dim_v].
//
// The same source compiles as host C++ with a shim that runs each block's
// threads on CPU threads (the engine's tests do, to check this kernel against
// the CPU kernel where no GPU is at hand); hence no warp intrinsics, and every
// thread reaches every `__syncthreads`.

#ifdef __CUDACC__
#include <cuda_fp16.h>
#endif

#ifndef PA_THREADS
#define PA_THREADS 128
#endif
#define PA_MAX_GROUP 8
#define PA_MAX_DIM 256
#define PA_DIM_PER_THREAD ((PA_MAX_DIM + PA_THREADS - 1) / PA_THREADS)

#define PA_F32 0
#define PA_F16 1
#define PA_BF16 2
#define PA_Q8_0 3

struct PaStored {
    long long start, cell, head, dim;
    long long s_start, s_cell, s_head, s_dim;
};

struct PaArgs {
    unsigned rows, n_heads, kv_heads, group, head_dim, head_dim_v, runs;
    float scale;
    PaStored k, v;
};

__device__ __forceinline__ float pa_bits_to_float(unsigned bits) {
#ifdef __CUDACC__
    return __uint_as_float(bits);
#else
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

__device__ __forceinline__ float pa_f16(unsigned short bits) {
#ifdef __CUDACC__
    return __half2float(__ushort_as_half(bits));
#else
    const unsigned sign = (unsigned)(bits & 0x8000u) << 16;
    const unsigned exp = (bits >> 10) & 0x1fu;
    const unsigned man = bits & 0x3ffu;
    if (exp == 0x1fu) {
        return pa_bits_to_float(sign | 0x7f800000u | (man << 13));
    }
    if (exp == 0) {
        const float tiny = (float)man * (1.0f / 16777216.0f);  // man * 2^-24
        return sign ? -tiny : tiny;
    }
    return pa_bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

__device__ __forceinline__ float pa_bf16(unsigned short bits) {
    return pa_bits_to_float((unsigned)bits << 16);
}

// Element (cell, head, d) of stored keys or values, as f32.
template <int KIND>
__device__ __forceinline__ float pa_load(const void* data, const unsigned short* scales, const PaStored& s,
                                         unsigned cell, unsigned head, unsigned d) {
    const long long at = s.start + (long long)cell * s.cell + (long long)head * s.head + (long long)d * s.dim;
    if (KIND == PA_F32) return ((const float*)data)[at];
    if (KIND == PA_F16) return pa_f16(((const unsigned short*)data)[at]);
    if (KIND == PA_BF16) return pa_bf16(((const unsigned short*)data)[at]);
    const long long sat =
        s.s_start + (long long)cell * s.s_cell + (long long)head * s.s_head + (long long)(d / 32) * s.s_dim;
    return ((float)((const unsigned char*)data)[at] - 128.0f) * pa_f16(scales[sat]);
}

// The scores of one cell against the group's query heads (in shared memory,
// `head_dim` apart), unscaled.
template <int KIND>
__device__ __forceinline__ void pa_scores(float* s, const float* q_s, const void* k, const unsigned short* ks,
                                          const PaArgs& a, unsigned cell, unsigned head) {
#pragma unroll
    for (unsigned h = 0; h < PA_MAX_GROUP; h++) s[h] = 0.0f;
    const unsigned hd = a.head_dim;
    if (KIND == PA_Q8_0) {
        // One scale per 32 values: sum the integers' products, then scale.
        for (unsigned d0 = 0; d0 < hd; d0 += 32) {
            const long long sat = a.k.s_start + (long long)cell * a.k.s_cell + (long long)head * a.k.s_head +
                                  (long long)(d0 / 32) * a.k.s_dim;
            const float scale = pa_f16(ks[sat]);
            float part[PA_MAX_GROUP];
#pragma unroll
            for (unsigned h = 0; h < PA_MAX_GROUP; h++) part[h] = 0.0f;
            for (unsigned d = d0; d < d0 + 32; d++) {
                const long long at =
                    a.k.start + (long long)cell * a.k.cell + (long long)head * a.k.head + (long long)d * a.k.dim;
                const float x = (float)((const unsigned char*)k)[at] - 128.0f;
#pragma unroll
                for (unsigned h = 0; h < PA_MAX_GROUP; h++)
                    if (h < a.group) part[h] += q_s[h * hd + d] * x;
            }
#pragma unroll
            for (unsigned h = 0; h < PA_MAX_GROUP; h++) s[h] += part[h] * scale;
        }
    } else {
        for (unsigned d = 0; d < hd; d++) {
            const float x = pa_load<KIND>(k, ks, a.k, cell, head, d);
#pragma unroll
            for (unsigned h = 0; h < PA_MAX_GROUP; h++)
                if (h < a.group) s[h] += q_s[h * hd + d] * x;
        }
    }
}

template <int KIND>
__device__ void pa_block(const float* __restrict__ q, const void* __restrict__ k,
                         const unsigned short* __restrict__ ks, const void* __restrict__ v,
                         const unsigned short* __restrict__ vs, const unsigned* __restrict__ runs,
                         float* __restrict__ out, const PaArgs a) {
    __shared__ float q_s[PA_MAX_GROUP * PA_MAX_DIM];
    __shared__ float p_s[PA_MAX_GROUP * PA_THREADS];
    __shared__ float red_s[PA_MAX_GROUP * PA_THREADS];
    __shared__ unsigned cell_s[PA_THREADS];
    __shared__ float max_s[PA_MAX_GROUP];
    __shared__ float sum_s[PA_MAX_GROUP];
    __shared__ float alpha_s[PA_MAX_GROUP];

    const unsigned row = blockIdx.x, head = blockIdx.y, t = threadIdx.x;
    const unsigned g = a.group, hd = a.head_dim, hdv = a.head_dim_v;
    const unsigned* offsets = runs;
    const unsigned* visible = offsets + a.rows + 1;
    const unsigned* starts = visible + a.rows;
    const unsigned* before = starts + a.runs;
    const unsigned first = offsets[row], last = offsets[row + 1], seen = visible[row];

    for (unsigned i = t; i < g * hd; i += PA_THREADS) {
        q_s[i] = q[((size_t)row * a.n_heads + (size_t)head * g + i / hd) * hd + i % hd];
    }
    if (t < g) {
        max_s[t] = -INFINITY;
        sum_s[t] = 0.0f;
    }
    // The values' dimensions among the threads: a head of at most PA_THREADS
    // values is taken by `splits` threads per dimension, each summing every
    // `splits`-th cell of a tile (`part`), their sums added at the end; a
    // longer head gives each thread dimensions t, t + PA_THREADS, ...
    const unsigned splits = hdv <= PA_THREADS ? PA_THREADS / hdv : 1;
    const unsigned part = hdv <= PA_THREADS ? t / hdv : 0;
    const unsigned dim0 = hdv <= PA_THREADS ? t % hdv : t;
    const bool adds = part < splits;
    float acc[PA_MAX_GROUP][PA_DIM_PER_THREAD];
#pragma unroll
    for (unsigned h = 0; h < PA_MAX_GROUP; h++)
#pragma unroll
        for (unsigned j = 0; j < PA_DIM_PER_THREAD; j++) acc[h][j] = 0.0f;
    __syncthreads();

    for (unsigned base = 0; base < seen; base += PA_THREADS) {
        const unsigned i = base + t;
        const bool mine = i < seen;
        float s[PA_MAX_GROUP];
        if (mine) {
            // The row's last run with `before <= i` holds its i-th visible cell.
            unsigned lo = first, hi = last;
            while (hi - lo > 1) {
                const unsigned mid = lo + (hi - lo) / 2;
                if (before[mid] <= i) lo = mid; else hi = mid;
            }
            const unsigned cell = starts[lo] + (i - before[lo]);
            cell_s[t] = cell;
            pa_scores<KIND>(s, q_s, k, ks, a, cell, head);
#pragma unroll
            for (unsigned h = 0; h < PA_MAX_GROUP; h++) s[h] *= a.scale;
        } else {
#pragma unroll
            for (unsigned h = 0; h < PA_MAX_GROUP; h++) s[h] = -INFINITY;
        }
#pragma unroll
        for (unsigned h = 0; h < PA_MAX_GROUP; h++)
            if (h < g) red_s[h * PA_THREADS + t] = s[h];
        __syncthreads();
        for (unsigned stride = PA_THREADS / 2; stride > 0; stride >>= 1) {
            if (t < stride)
                for (unsigned h = 0; h < g; h++)
                    red_s[h * PA_THREADS + t] = fmaxf(red_s[h * PA_THREADS + t], red_s[h * PA_THREADS + t + stride]);
            __syncthreads();
        }
        // Every tile holds a visible cell (its first), so each new maximum is finite.
        float new_max[PA_MAX_GROUP];
#pragma unroll
        for (unsigned h = 0; h < PA_MAX_GROUP; h++)
            new_max[h] = h < g ? fmaxf(max_s[h], red_s[h * PA_THREADS]) : 0.0f;
        __syncthreads();  // all have read the maxima before the sums overwrite them
#pragma unroll
        for (unsigned h = 0; h < PA_MAX_GROUP; h++)
            if (h < g) {
                const float p = mine ? expf(s[h] - new_max[h]) : 0.0f;
                p_s[h * PA_THREADS + t] = p;
                red_s[h * PA_THREADS + t] = p;
            }
        __syncthreads();
        for (unsigned stride = PA_THREADS / 2; stride > 0; stride >>= 1) {
            if (t < stride)
                for (unsigned h = 0; h < g; h++) red_s[h * PA_THREADS + t] += red_s[h * PA_THREADS + t + stride];
            __syncthreads();
        }
        if (t < g) {
            // exp(-inf) is 0 on the first tile: nothing summed yet to rescale.
            const float alpha = expf(max_s[t] - new_max[t]);
            sum_s[t] = sum_s[t] * alpha + red_s[t * PA_THREADS];
            max_s[t] = new_max[t];
            alpha_s[t] = alpha;
        }
        __syncthreads();
        const unsigned tile = seen - base < PA_THREADS ? seen - base : PA_THREADS;
#pragma unroll
        for (unsigned j = 0; j < PA_DIM_PER_THREAD; j++) {
            const unsigned d = dim0 + j * PA_THREADS;
            if (adds && d < hdv) {
#pragma unroll
                for (unsigned h = 0; h < PA_MAX_GROUP; h++)
                    if (h < g) acc[h][j] *= alpha_s[h];
                for (unsigned c = part; c < tile; c += splits) {
                    const float x = pa_load<KIND>(v, vs, a.v, cell_s[c], head, d);
#pragma unroll
                    for (unsigned h = 0; h < PA_MAX_GROUP; h++)
                        if (h < g) acc[h][j] += p_s[h * PA_THREADS + c] * x;
                }
            }
        }
        __syncthreads();  // the next tile overwrites the cells and probabilities
    }

    if (splits > 1) {
        // Add up the parts' sums (the same for every thread of the block: hdv
        // is the block's). The loop's last barrier freed `red_s`, which holds
        // PA_THREADS * PA_MAX_GROUP >= splits * hdv * group floats.
#pragma unroll
        for (unsigned h = 0; h < PA_MAX_GROUP; h++)
            if (adds && h < g) red_s[(part * g + h) * hdv + dim0] = acc[h][0];
        __syncthreads();
        if (part == 0) {
#pragma unroll
            for (unsigned h = 0; h < PA_MAX_GROUP; h++)
                if (h < g) {
                    float total = 0.0f;
                    for (unsigned p = 0; p < splits; p++) total += red_s[(p * g + h) * hdv + dim0];
                    acc[h][0] = total;
                }
        }
    }
#pragma unroll
    for (unsigned j = 0; j < PA_DIM_PER_THREAD; j++) {
        const unsigned d = dim0 + j * PA_THREADS;
        if (part == 0 && d < hdv) {
#pragma unroll
            for (unsigned h = 0; h < PA_MAX_GROUP; h++)
                if (h < g) {
                    const float total = sum_s[h];
                    out[((size_t)row * a.n_heads + (size_t)head * g + h) * hdv + d] =
                        total > 0.0f ? acc[h][j] / total : 0.0f;
                }
        }
    }
}

#define PA_KERNEL(name, KIND)                                                                          \
    extern "C" __global__ void name(const float* q, const void* k, const unsigned short* ks, const void* v, \
                                    const unsigned short* vs, const unsigned* runs, float* out,           \
                                    const PaArgs a) {                                                    \
        pa_block<KIND>(q, k, ks, v, vs, runs, out, a);                                                   \
    }

PA_KERNEL(paged_attention_f32, PA_F32)
PA_KERNEL(paged_attention_f16, PA_F16)
PA_KERNEL(paged_attention_bf16, PA_BF16)
PA_KERNEL(paged_attention_q8_0, PA_Q8_0)
