// Runs the engine's CUDA paged-attention kernel on the CPU through shim.h.
//
// Usage: harness LAUNCHES OUT. LAUNCHES holds records, one per launch, until
// its end: a u32 kernel kind (0 f32, 1 f16, 2 bf16, 3 q8_0), the kernel's
// `PaArgs` as bytes, then six blobs (a u64 byte count and the bytes): the
// queries, keys, key scales, values, value scales and run lists. OUT gets each
// launch's output, `rows * n_heads * head_dim_v` f32 values, one after another.
#include "shim.h"

#include "../../cuda/paged_attention.cu"

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>

typedef void (*Kernel)(const float*, const void*, const unsigned short*, const void*, const unsigned short*,
                       const unsigned*, float*, const PaArgs);

static const Kernel KERNELS[] = {paged_attention_f32, paged_attention_f16, paged_attention_bf16,
                                 paged_attention_q8_0};

struct Reader {
    std::vector<char> bytes;
    size_t at = 0;

    bool done() const { return at == bytes.size(); }

    void take(void* dst, size_t n) {
        if (bytes.size() - at < n) {
            fprintf(stderr, "harness: launch file ends early\n");
            exit(2);
        }
        memcpy(dst, bytes.data() + at, n);
        at += n;
    }

    // A blob, copied into storage aligned for any element type.
    std::vector<uint64_t> blob() {
        uint64_t n = 0;
        take(&n, sizeof n);
        std::vector<uint64_t> out((n + 7) / 8 + 1);
        take(out.data(), n);
        return out;
    }
};

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: harness LAUNCHES OUT\n");
        return 2;
    }
    std::ifstream in(argv[1], std::ios::binary);
    Reader r{std::vector<char>(std::istreambuf_iterator<char>(in), {})};
    std::ofstream out(argv[2], std::ios::binary);
    while (!r.done()) {
        uint32_t kind = 0;
        r.take(&kind, sizeof kind);
        PaArgs a;
        r.take(&a, sizeof a);
        if (kind > 3) {
            fprintf(stderr, "harness: kernel kind %u\n", kind);
            return 2;
        }
        auto q = r.blob(), k = r.blob(), ks = r.blob(), v = r.blob(), vs = r.blob(), runs = r.blob();
        std::vector<float> o((size_t)a.rows * a.n_heads * a.head_dim_v, NAN);
        const Kernel kernel = KERNELS[kind];
        shim_launch(dim3{a.rows, a.kv_heads, 1}, PA_THREADS, [&] {
            kernel((const float*)q.data(), k.data(), (const unsigned short*)ks.data(), v.data(),
                   (const unsigned short*)vs.data(), (const unsigned*)runs.data(), o.data(), a);
        });
        out.write((const char*)o.data(), (std::streamsize)(o.size() * sizeof(float)));
    }
    return 0;
}
