// ParallelFor over XLA:CPU's intra-op thread pool, shared by the native CPU kernels.

#ifndef JENGINE_PARALLEL_FOR_H_
#define JENGINE_PARALLEL_FOR_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jengine {

// Runs fn(i, worker) for i < n on the calling thread and up to `threads - 1` pool workers.
// The caller takes tasks too and waits only for tasks, never for a worker to start, so a busy
// pool cannot deadlock it; a worker that starts late finds nothing left and returns.
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, int64_t threads,
                 const std::function<void(int64_t, int64_t)>& fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0}, worker_ids{1};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  const int64_t n_tasks = n;
  auto work = [state, n_tasks, &fn](int64_t worker) {
    for (int64_t i; (i = state->next.fetch_add(1)) < n_tasks;) {
      fn(i, worker);
      if (state->done.fetch_add(1) + 1 == n_tasks) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::max<int64_t>(0, std::min(threads, n) - 1);
  std::vector<std::thread> own;
  if (pool.num_threads() > 0) {
    for (int64_t w = 0; w < helpers; ++w) {
      pool.Schedule([state, work]() { work(state->worker_ids.fetch_add(1)); });
    }
  } else {  // no intra-op pool in this runtime: a few threads of our own, joined below
    for (int64_t w = 0; w < helpers; ++w) own.emplace_back(work, w + 1);
  }
  work(0);
  {
    std::unique_lock<std::mutex> lock(state->mu);
    state->cv.wait(lock, [&] { return state->done.load() >= n_tasks; });
  }
  for (auto& t : own) t.join();
}

// The threads a kernel may use: XLA's intra-op pool, a few of its own without one, at most
// `max_threads` when that is positive.
inline int64_t KernelThreads(xla::ffi::ThreadPool& pool, int32_t max_threads) {
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (pool.num_threads() <= 0) {
    threads = std::min<int64_t>(4, std::max<unsigned>(1, std::thread::hardware_concurrency()));
  }
  if (max_threads > 0) threads = std::min<int64_t>(threads, max_threads);
  return threads;
}

}  // namespace jengine

#endif  // JENGINE_PARALLEL_FOR_H_
