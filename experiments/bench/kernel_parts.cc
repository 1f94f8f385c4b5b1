// Where the CPU decode-attention kernel's time goes at batch 1 (driver for
// experiments/bench/kernel_parts.py, which builds it with the kernel's own flags and
// -DKERNEL_SOURCE="<path of decode_attention.cc>").
//
// SmolLM2-135M's decode shapes: 3 kv heads (rows) of 3 query rows each, 64 channels, dense
// float32 keys and values, all slots visible. Three measurements, each the median over
// `repeats` runs, printed as one JSON object:
//   stages  the kernel's three passes (scores, softmax, weighted values) over n slots of one
//           row, single thread, n = 64 (data in L1) and 512 (in L2): ns per slot;
//   items   run_item over every (row, chunk) item of `layers` distinct layers of `slots` slots
//           (the step's attention, from memory) and of one layer `layers` times (from the
//           shared cache), on 1 and 2 threads (thread t takes items t, t + T, ...; no barrier);
//   read    a pure read (a sum) of the same layers' keys and values on 1 and 2 threads;
// and max_abs_error: the kernel's outputs over the first layer against a float64 reference.
// (`sink` fields: sums of what a measurement computed, printed so the compiler keeps the work.)
#include KERNEL_SOURCE

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kQ = 3, kD = 64, kRows = 3;

template <typename F>
double median_ms(int repeats, F&& f) {
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    const auto start = Clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Runs body(t) on `threads` threads (the calling one included) and waits.
template <typename F>
void on_threads(int threads, F&& body) {
  std::vector<std::thread> helpers;
  for (int t = 1; t < threads; ++t) helpers.emplace_back(body, t);
  body(0);
  for (auto& h : helpers) h.join();
}

std::vector<float> pseudo_random(size_t n) {
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>((i * 2654435761u) % 1000) / 1000.f - 0.5f;
  return x;
}

Problem layer_problem(const float* keys, const float* values, const float* q, const bool* mask,
                      int64_t slots, int64_t chunk) {
  Problem P;
  P.rows = kRows;
  P.n_q = kQ;
  P.dim = kD;
  P.slots = slots;
  for (int which = 0; which < 2; ++which) {
    Tensor t{};
    t.format = kDense;
    t.type = ffi::DataType::F32;
    t.data = which ? values : keys;
    t.rows = kRows;
    t.slots = slots;
    t.dim = kD;
    (which ? P.v : P.k) = t;
  }
  P.q = q;
  P.mask = mask;
  P.length = slots;
  P.scale = 0.125f;
  P.softcap = 0.0f;
  P.round_p = false;
  P.chunk = chunk;
  P.chunks = (slots + chunk - 1) / chunk;
  const int64_t items = kRows * P.chunks;
  P.m.resize(items * kQ);
  P.l.resize(items * kQ);
  P.acc.resize(items * kQ * kD);
  return P;
}

// ns per slot (all kQ query rows) of each pass over n slots of one row, data reused.
std::string stages(int64_t n, int repeats) {
  const int64_t calls = std::max<int64_t>(1, (1 << 20) / n);
  std::vector<float> k = pseudo_random(n * kD), v = pseudo_random(n * kD);
  std::vector<float> q(kQ * kD, 0.1f), scores(kQ * n), acc(kQ * kD);
  std::unique_ptr<bool[]> visible(new bool[kQ * n]);
  std::fill(visible.get(), visible.get() + kQ * n, true);
  const Problem P = layer_problem(k.data(), v.data(), q.data(), visible.get(), n, n);
  float sink = 0.0f;
  auto per_slot = [&](auto&& pass) {
    return 1e6 * median_ms(repeats, [&] { for (int64_t c = 0; c < calls; ++c) pass(); }) /
           static_cast<double>(calls * n);
  };
  const double score_ns = per_slot([&] {
    for (int64_t t0 = 0; t0 < n; t0 += kTile)
      dense_tile_scores<kQ, kD>(k.data() + t0 * kD, q.data(), kQ, kD, scores.data() + t0, n);
  });
  float m[kQ], l[kQ];
  const double softmax_ns = per_slot([&] {  // run_item's own pass: scale, mask, max, exp, sum
    softmax_weights(P, scores.data(), n, visible.get(), kQ, n, m, l);
    sink += l[0];
  });
  const double value_ns = per_slot([&] {
    add_dense_values_run<kQ, kD>(P.v, 0, 0, v.data(), n, scores.data(), n, acc.data());
  });
  sink += acc[0];
  char out[256];
  std::snprintf(out, sizeof out,
                "{\"slots\": %lld, \"scores_ns\": %.2f, \"softmax_ns\": %.2f, \"values_ns\": %.2f, "
                "\"sink\": %.3g}",
                static_cast<long long>(n), score_ns, softmax_ns, value_ns, sink);
  return out;
}

// Largest |kernel - reference| over one layer's attention outputs (one item per row, so no
// merge): run_item's acc / l against softmax(scale q.k) v in double precision.
double max_error(const float* keys, const float* values, const float* q, const bool* mask,
                 int64_t slots) {
  Problem P = layer_problem(keys, values, q, mask, slots, slots);
  double worst = 0.0;
  std::vector<double> p(slots);
  for (int64_t r = 0; r < kRows; ++r) {
    run_item<kQ, kD>(P, r);
    for (int64_t i = 0; i < kQ; ++i) {
      const float* qi = q + (r * kQ + i) * kD;
      double top = -1e300, total = 0.0;
      for (int64_t s = 0; s < slots; ++s) {
        double dot = 0.0;
        for (int64_t c = 0; c < kD; ++c) dot += double(qi[c]) * keys[(r * slots + s) * kD + c];
        p[s] = dot * P.scale;
        top = std::max(top, p[s]);
      }
      for (int64_t s = 0; s < slots; ++s) total += p[s] = std::exp(p[s] - top);
      for (int64_t c = 0; c < kD; ++c) {
        double want = 0.0;
        for (int64_t s = 0; s < slots; ++s) want += p[s] * values[(r * slots + s) * kD + c];
        const double got = P.acc[(r * kQ + i) * kD + c] / P.l[r * kQ + i];
        worst = std::max(worst, std::abs(got - want / total));
      }
    }
  }
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: kernel_parts LAYERS SLOTS CHUNK REPEATS\n");
    return 2;
  }
  const int64_t layers = std::atoll(argv[1]), slots = std::atoll(argv[2]),
                chunk = std::atoll(argv[3]);
  const int repeats = std::atoi(argv[4]);
  const int64_t layer_floats = kRows * slots * kD;  // keys or values of one layer
  std::vector<float> cache = pseudo_random(static_cast<size_t>(layers) * 2 * layer_floats);
  std::vector<float> q = pseudo_random(kRows * kQ * kD);
  std::vector<uint8_t> visible(kRows * kQ * slots, 1);
  const bool* mask = reinterpret_cast<const bool*>(visible.data());
  const double bytes = 2.0 * layers * layer_floats * sizeof(float);

  std::string items_json, read_json;
  for (int threads = 1; threads <= 2; ++threads) {
    for (int distinct = 1; distinct >= 0; --distinct) {
      const double ms = median_ms(repeats, [&] {
        on_threads(threads, [&](int t) {
          for (int64_t layer = 0; layer < layers; ++layer) {
            const float* keys = cache.data() + (distinct ? layer : 0) * 2 * layer_floats;
            Problem P = layer_problem(keys, keys + layer_floats, q.data(), mask, slots, chunk);
            for (int64_t item = t; item < kRows * P.chunks; item += threads)
              run_item<kQ, kD>(P, item);
          }
        });
      });
      char row[200];
      std::snprintf(row, sizeof row, "%s{\"threads\": %d, \"from\": \"%s\", \"ms\": %.6g, \"gbs\": %.6g}",
                    items_json.empty() ? "" : ", ", threads, distinct ? "memory" : "shared cache",
                    ms, bytes / ms / 1e6);
      items_json += row;
    }
    std::vector<float> sums(threads);
    const double ms = median_ms(repeats, [&] {
      on_threads(threads, [&](int t) {
        const size_t n = cache.size() / threads;
        const float* x = cache.data() + t * n;
        f32x16 a[4] = {};
        for (size_t i = 0; i + 64 <= n; i += 64)
          for (int j = 0; j < 4; ++j) a[j] += load16<f32x16>(x + i + 16 * j);
        sums[t] = lane_sum(a[0] + a[1] + a[2] + a[3]);
      });
    });
    char row[160];
    std::snprintf(row, sizeof row, "%s{\"threads\": %d, \"ms\": %.6g, \"gbs\": %.6g, \"sink\": %.3g}",
                  read_json.empty() ? "" : ", ", threads, ms, bytes / ms / 1e6, sums[0]);
    read_json += row;
  }
  const double error = max_error(cache.data(), cache.data() + layer_floats, q.data(), mask, slots);
  std::printf("{\"rows\": %lld, \"layers\": %lld, \"slots\": %lld, \"chunk\": %lld, \"repeats\": %d, "
              "\"mbytes\": %.6g, \"max_abs_error\": %.3g,\n \"stages\": [%s, %s],\n "
              "\"items\": [%s],\n \"read\": [%s]}\n",
              static_cast<long long>(kRows), static_cast<long long>(layers),
              static_cast<long long>(slots), static_cast<long long>(chunk), repeats, bytes / 1e6,
              error, stages(64, repeats).c_str(),
              stages(512, repeats).c_str(), items_json.c_str(), read_json.c_str());
  return 0;
}
