// One extra thread of the native kernels' own that, between calls, waits for work by spinning
// a short while before it sleeps.
//
// Why: handing half of a short call to XLA's intra-op pool (ParallelFor) waits for a pool
// thread to wake, which on the 2-core Xeon measured took about as long as a one-row projection's
// half of the work, so the second core added little: SmolLM2's 210 bf16 projections of one row
// (scripts/amx_matmul_bench.py) took 11-15 ms on the pool's two threads and 16 on one, where a
// plain C++ loop of tile loads streams their 212 MB in 7.3-8 ms on both cores. With a helper
// still spinning from the previous call they took 7.3-7.9 ms, and decode steps of 1-4
// sequences 0.80-0.89x, 8-16 0.94-0.98x (docs/kernels.md, "AMX bf16 projections"). Longer
// calls keep the pool: with the helper for every call, 64-row steps and 512-token chunks ran
// 1.04-1.1x as long (a spinning thread beside XLA's own parallel work).

#ifndef JENGINE_SPIN_HELPER_H_
#define JENGINE_SPIN_HELPER_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define JE_SPIN_PAUSE() _mm_pause()
#else
#define JE_SPIN_PAUSE() std::this_thread::yield()
#endif

namespace jengine {

class SpinHelper {
 public:
  static constexpr int64_t kSpinMicros = 50;  // 10, 50 and 200 measured: 50 as good as any

  static SpinHelper& Get() {
    static SpinHelper* helper = [] {  // never freed: its thread outlives statics
      auto* h = new SpinHelper();
      instance_.store(h, std::memory_order_release);
      return h;
    }();
    return *helper;
  }

  // Whether the helper thread exists and is still spinning from a call just before (not
  // asleep). A short call that finds it so takes it; one that does not keeps XLA's pool: in a
  // step whose projections run on the pool (f32 weights), waking the helper cost as much as a
  // pool thread, and its spinning after the call slowed the pool's next work (decode steps of
  // 1 and 8 sequences 1.06x and 1.10x as long, session 21).
  static bool Awake() {
    const SpinHelper* h = instance_.load(std::memory_order_acquire);
    return h != nullptr && !h->sleeping_.load(std::memory_order_relaxed);
  }

  // Runs fn(i, worker) for every i < n on the calling thread (worker 0) and, unless another call
  // holds it, the helper thread (worker 1); returns when all are done. Tasks are claimed one at
  // a time, so a helper that starts late takes fewer (none when the caller finished them all:
  // then it is not waited for). In a forked child, which has no helper thread, the caller runs
  // every task.
  void Run(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
    if (n <= 1 || busy_.exchange(true, std::memory_order_acquire)) {
      for (int64_t i = 0; i < n; ++i) fn(i, 0);
      return;
    }
    Job job{&fn, n};
    job_.store(&job, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst)) {
      std::lock_guard<std::mutex> lock(mu_);
      wake_.notify_one();
    }
    job.Work(0);
    Job* unclaimed = &job;
    if (!job_.compare_exchange_strong(unclaimed, nullptr)) {  // the helper took it
      while (!job.helper_done.load(std::memory_order_acquire)) JE_SPIN_PAUSE();
    }
    busy_.store(false, std::memory_order_release);
  }

 private:
  struct Job {
    const std::function<void(int64_t, int64_t)>* fn;
    int64_t n;
    std::atomic<int64_t> next{0};
    std::atomic<bool> helper_done{false};

    void Work(int64_t worker) {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) (*fn)(i, worker);
    }
  };

  SpinHelper() { std::thread([this] { Loop(); }).detach(); }

  Job* Wait() {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
    for (int64_t spins = 0;; ++spins) {
      if (job_.load(std::memory_order_relaxed) != nullptr) {
        if (Job* job = job_.exchange(nullptr, std::memory_order_acq_rel)) return job;
      }
      JE_SPIN_PAUSE();
      if ((spins & 255) == 255 && std::chrono::steady_clock::now() > until) {
        std::unique_lock<std::mutex> lock(mu_);
        sleeping_.store(true, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return job_.load(std::memory_order_seq_cst) != nullptr; });
        sleeping_.store(false, std::memory_order_relaxed);
      }
    }
  }

  void Loop() {
    for (;;) {
      Job* job = Wait();
      job->Work(1);
      job->helper_done.store(true, std::memory_order_release);
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::atomic<Job*> job_{nullptr};  // posted by Run, taken by the helper or withdrawn by Run
  std::atomic<bool> busy_{false};   // a Run holds the helper
  std::atomic<bool> sleeping_{false};
  static inline std::atomic<SpinHelper*> instance_{nullptr};
};

}  // namespace jengine

#endif  // JENGINE_SPIN_HELPER_H_
