// SPDX-License-Identifier: Apache-2.0
// The speed anchor for gradcomp's top-k on a GPU: CUB's DeviceTopK (CCCL 3.2 or newer) selecting
// the k largest |g| with their indices, timed beside a plain copy of g in the same process.
//
// DeviceTopK is unordered and not deterministic (the only mode it offers), so it cannot replace
// gradcomp's selection, whose output must be bitwise the same on every rank and equal to its CPU
// twin; it tells us how far from the state of the art our selection is. It is built outside the
// CMake tree because CUDA 13.0's own CCCL has no DeviceTopK: scripts/gpu_check.sh --prepare copies
// the headers of the `nvidia-cuda-cccl` wheel into .gpu-deps/cccl, and its `cub` step compiles this
// file against them (they come first on the include path, ahead of the toolkit's CCCL).
//
//   nvcc -std=c++17 -O3 -arch=native -I .gpu-deps/cccl bench/cub_topk_anchor.cu -o cub_topk_anchor
//   ./cub_topk_anchor 25000000 110000000      (density 0.1%: k = ceil(0.001 n))
//
// Output: one JSON line per size: n, k, median ms over 20 calls of the copy and of MaxPairs
// (keys |g| through a transform iterator, values the indices), temp bytes, and a check that the
// smallest selected key is >= the k-th largest |g| found by sorting a copy (exact, with Thrust).
#include <cub/device/device_topk.cuh>
#include <cuda/__execution/determinism.h>
#include <cuda/__execution/output_ordering.h>
#include <cuda/__execution/require.h>
#include <thrust/device_ptr.h>
#include <thrust/device_vector.h>
#include <thrust/extrema.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <thrust/sort.h>
#include <thrust/transform.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CHECK(x)                                                                 \
  do {                                                                           \
    cudaError_t e_ = (x);                                                        \
    if (e_ != cudaSuccess) {                                                     \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)

struct AbsOf {
  __host__ __device__ float operator()(float v) const { return fabsf(v); }
};

template <class F>
static double median_ms(F&& f, int calls = 20) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> ms;
  for (int i = 0; i < calls; ++i) {
    CHECK(cudaEventRecord(a));
    f();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return ms[ms.size() / 2];
}

int main(int argc, char** argv) {
  std::vector<long long> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(std::atoll(argv[i]));
  if (sizes.empty()) sizes = {25000000LL, 110000000LL};
  const auto env = cuda::execution::require(cuda::execution::determinism::not_guaranteed,
                                            cuda::execution::output_ordering::unsorted);
  for (long long n : sizes) {
    const long long k = static_cast<long long>(std::ceil(0.001 * static_cast<double>(n)));
    std::vector<float> host(static_cast<size_t>(n));
    std::mt19937 gen(1);
    std::normal_distribution<float> dist;
    for (auto& v : host) v = dist(gen);
    thrust::device_vector<float> g(host.begin(), host.end()), copy(n);
    thrust::device_vector<float> keys_out(k);
    thrust::device_vector<int> idx_out(k);
    auto keys_in = thrust::make_transform_iterator(g.data(), AbsOf{});
    auto idx_in = thrust::make_counting_iterator<int>(0);

    size_t temp_bytes = 0;
    CHECK(cub::DeviceTopK::MaxPairs(nullptr, temp_bytes, keys_in, keys_out.data(), idx_in,
                                    idx_out.data(), n, k, env));
    void* temp = nullptr;
    CHECK(cudaMalloc(&temp, std::max<size_t>(temp_bytes, 1)));
    auto topk = [&] {
      size_t bytes = temp_bytes;
      CHECK(cub::DeviceTopK::MaxPairs(temp, bytes, keys_in, keys_out.data(), idx_in,
                                      idx_out.data(), n, k, env));
    };
    auto copy_g = [&] {
      CHECK(cudaMemcpyAsync(thrust::raw_pointer_cast(copy.data()),
                            thrust::raw_pointer_cast(g.data()), sizeof(float) * n,
                            cudaMemcpyDeviceToDevice));
    };
    const double copy_ms = median_ms(copy_g);
    const double topk_ms = median_ms(topk);
    CHECK(cudaDeviceSynchronize());

    // check: the k-th largest |g| by an exact sort of a copy; every selected key at least that,
    // and each selected key equal to |g| at its index
    thrust::device_vector<float> sorted(n);
    thrust::transform(g.begin(), g.end(), sorted.begin(), AbsOf{});
    thrust::sort(sorted.begin(), sorted.end());
    const float kth = sorted[n - k];
    const float min_sel = *thrust::min_element(keys_out.begin(), keys_out.end());
    std::vector<float> ko(k);
    std::vector<int> io(k);
    thrust::copy(keys_out.begin(), keys_out.end(), ko.begin());
    thrust::copy(idx_out.begin(), idx_out.end(), io.begin());
    bool ok = min_sel >= kth;
    for (long long i = 0; i < k && ok; ++i)
      ok = io[i] >= 0 && io[i] < n && ko[i] == std::fabs(host[io[i]]);
    std::printf(
        "{\"n\": %lld, \"k\": %lld, \"copy_ms\": %.5f, \"copy_GBps\": %.1f, \"cub_topk_ms\": %.5f, "
        "\"temp_bytes\": %zu, \"check\": \"%s\"}\n",
        n, k, copy_ms, 8.0 * n / copy_ms / 1e6, topk_ms, temp_bytes, ok ? "ok" : "FAIL");
    CHECK(cudaFree(temp));
    if (!ok) return 2;
  }
  return 0;
}
