// The teams of parallel.h: one OpenMP region whose threads other than the caller's
// wait, spinning, for the caller's loops.
#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace tmpar {
namespace {

// A job word: (generation << 16) | number of chunks; kStop chunks ends the team.
constexpr uint64_t kChunkBits = 16, kStop = (1u << kChunkBits) - 1;

struct Team {
  alignas(64) std::atomic<uint64_t> job{0};
  alignas(64) std::atomic<int64_t> done{0};  // chunks past chunk 0 finished
  alignas(64) ChunkFn fn = nullptr;          // the job, written before `job` is published
  const void* ctx = nullptr;
  int64_t begin = 0, end = 0, chunk = 0;
  uint64_t generation = 0;
  int size = 1;
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // the first chunk error of the job (`failed` claims it)

  void run_chunk(int64_t i) noexcept {
    const int64_t b0 = begin + i * chunk, b1 = std::min(end, b0 + chunk);
    try {
      fn(ctx, b0, b1);
    } catch (...) {
      if (!failed.exchange(true)) error = std::current_exception();
    }
  }
  void publish(uint64_t chunks) {
    job.store((++generation << kChunkBits) | chunks, std::memory_order_release);
  }
};

std::atomic<bool> teams_on{true};
std::atomic<int64_t> loops_handed{0};
thread_local Team* led = nullptr;  // the team this thread leads, outside its chunks

// A wait's spin: short pauses (the other thread of the core keeps most of its issue
// slots), then yields, so a thread descheduled on a busy machine gets its core back.
inline void relax(int64_t& spins) {
  if (++spins < (1 << 14)) {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  } else {
    std::this_thread::yield();
  }
}

// A thread of the team other than the leader: run chunk `tid` of each job that has one.
void serve(Team& t, int tid) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t w;
    int64_t spins = 0;
    while ((w = t.job.load(std::memory_order_acquire)) == seen) relax(spins);
    seen = w;
    const uint64_t chunks = w & kStop;
    if (chunks == kStop) return;
    if (static_cast<uint64_t>(tid) < chunks) {
      t.run_chunk(tid);
      t.done.fetch_add(1, std::memory_order_release);
    }
  }
}

}  // namespace

int team_size() { return led != nullptr ? led->size : 0; }

bool set_teams(bool on) { return teams_on.exchange(on); }

int64_t team_loops() { return loops_handed.load(std::memory_order_relaxed); }

void team_for(int64_t begin, int64_t end, int64_t chunk, int64_t nchunks, ChunkFn fn,
              const void* ctx) {
  Team& t = *led;
  TORCH_CHECK(nchunks >= 1 && nchunks <= t.size, "team_for: bad chunk count");
  t.fn = fn;
  t.ctx = ctx;
  t.begin = begin;
  t.end = end;
  t.chunk = chunk;
  t.done.store(0, std::memory_order_relaxed);
  loops_handed.fetch_add(1, std::memory_order_relaxed);
  t.publish(static_cast<uint64_t>(nchunks));
  led = nullptr;  // a loop inside the chunk runs inline (at::parallel_for in a region)
  t.run_chunk(0);
  led = &t;
  int64_t spins = 0;
  while (t.done.load(std::memory_order_acquire) < nchunks - 1) relax(spins);
  if (t.failed.load(std::memory_order_relaxed)) {
    std::exception_ptr e = t.error;
    t.error = nullptr;
    t.failed.store(false, std::memory_order_relaxed);
    std::rethrow_exception(e);
  }
}

void run_team(void (*body)(void*), void* ctx) {
#ifdef _OPENMP
  const int threads = at::get_num_threads();
  if (threads <= 1 || led != nullptr || at::in_parallel_region() ||
      !teams_on.load(std::memory_order_relaxed)) {
    body(ctx);
    return;
  }
  Team t;
  // One index per thread: at::parallel_for's region, its thread ids and its error
  // handling; thread 0 (this one) leads.
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const int tid = omp_get_thread_num();
    if (tid != 0) {
      serve(t, tid);
      return;
    }
    // The threads that serve: all of the region's, unless it has fewer than `threads`
    // (at::parallel_for then gives some several indices and may leave the last without
    // any); at most what a job word counts (kChunkBits: the others only wait).
    const int n = omp_get_num_threads(), per = (threads + n - 1) / n;
    t.size = std::min({n, (threads + per - 1) / per, static_cast<int>(kStop) - 1});
    led = &t;
    try {
      body(ctx);
    } catch (...) {
      led = nullptr;
      t.publish(kStop);
      throw;
    }
    led = nullptr;
    t.publish(kStop);
  });
#else
  body(ctx);
#endif
}

}  // namespace tmpar
