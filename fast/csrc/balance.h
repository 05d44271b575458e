// How a streaming kernel shares its items (groups of weight rows) out over the threads when
// the cores do not run at one speed. at::parallel_for gives each thread an equal contiguous
// range, and the step waits for the slowest; on a shared VM one core can stream a third slower
// than the other, and every decode linear then waits on it. Here each thread still owns one
// contiguous range and reads it front to back (one memory stream, as before); a thread whose
// range is done takes items one at a time from the back of the range with the most left.
//
//   balanced_for(n, [&](Claims& claims) {
//     per-thread setup;
//     for (int64_t i; claims.next(i);) item(i);
//   });
//
// Every item is claimed exactly once (an atomic front/back pair per range); which thread
// computes an item never changes what it computes, so results are the same bits at any
// thread count. Nested in a parallel region, or with one thread, it runs in the caller.
#pragma once
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>

class Claims {
 public:
  // A range's front (low 32 bits) and back (high 32 bits), on a cache line of its own.
  struct alignas(64) Range {
    std::atomic<uint64_t> ends{0};
  };

  Claims(Range* ranges, int count, int own) : ranges_(ranges), count_(count), own_(own) {}

  // The next item: the front of this thread's own range, then the back of the fullest other.
  bool next(int64_t& item) {
    if (own_ >= 0) {
      if (take(ranges_[own_], true, item)) return true;
      own_ = -1;
    }
    for (;;) {
      int best = -1;
      uint64_t most = 0;
      for (int r = 0; r < count_; ++r) {
        const uint64_t e = ranges_[r].ends.load(std::memory_order_relaxed);
        const uint64_t left = back(e) > front(e) ? back(e) - front(e) : 0;
        if (left > most) most = left, best = r;
      }
      if (best < 0) return false;
      if (take(ranges_[best], false, item)) return true;
    }
  }

  static uint64_t pack(uint64_t f, uint64_t b) { return f | b << 32; }

 private:
  static uint64_t front(uint64_t e) { return e & 0xFFFFFFFFu; }
  static uint64_t back(uint64_t e) { return e >> 32; }

  // One item off the front (the owner) or the back (a thief), or false once the range is empty.
  static bool take(Range& r, bool from_front, int64_t& item) {
    uint64_t e = r.ends.load(std::memory_order_relaxed);
    while (front(e) < back(e)) {
      const uint64_t next = from_front ? pack(front(e) + 1, back(e)) : pack(front(e), back(e) - 1);
      if (r.ends.compare_exchange_weak(e, next, std::memory_order_relaxed)) {
        item = static_cast<int64_t>(from_front ? front(e) : back(e) - 1);
        return true;
      }
    }
    return false;
  }

  Range* ranges_;
  int count_, own_;
};

// body(Claims&) on every thread of one parallel region (see above); n < 2^32 items.
template <typename Body>
void balanced_for(int64_t n, const Body& body) {
  if (n <= 0) return;
  const int threads = at::in_parallel_region() ? 1 : static_cast<int>(std::min<int64_t>(at::get_num_threads(), n));
  if (threads == 1) {  // every item in the caller, in order
    Claims::Range all;
    all.ends.store(Claims::pack(0, n), std::memory_order_relaxed);
    Claims claims(&all, 1, 0);
    body(claims);
    return;
  }
  std::unique_ptr<Claims::Range[]> ranges(new Claims::Range[threads]);
  for (int t = 0; t < threads; ++t)
    ranges[t].ends.store(Claims::pack(n * t / threads, n * (t + 1) / threads), std::memory_order_relaxed);
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    // A team smaller than asked leaves some ranges unowned: the others take them from the back.
    const int t = omp_get_thread_num();
    Claims claims(ranges.get(), threads, t < threads ? t : -1);
    try {
      body(claims);
    } catch (...) {
#pragma omp critical(step14_balanced_for)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

// body(begin, end) over [0, n) in chunks of ``grain`` items (the last may be short), shared out
// as balanced_for shares items; ``setup()`` once per thread gives the state body takes.
template <typename Setup, typename Body>
void balanced_chunks(int64_t n, int64_t grain, const Setup& setup, const Body& body) {
  balanced_for((n + grain - 1) / grain, [&](Claims& claims) {
    auto state = setup();
    for (int64_t c; claims.next(c);) body(state, c * grain, std::min(n, (c + 1) * grain));
  });
}
