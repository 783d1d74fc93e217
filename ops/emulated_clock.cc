#include "emulated_clock.h"

#include <atomic>
#include <cstdint>

namespace prophet_tf {

namespace {

// Nanoseconds since the clock's epoch of the latest noted moment.
std::atomic<int64_t> last_ready_ns{INT64_MIN};
std::atomic<bool> in_use{false};

int64_t ToNs(EmulatedClock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

}  // namespace

bool EmulatedClockInUse() { return in_use.load(std::memory_order_relaxed); }

void NoteDataReady(EmulatedClock::time_point t) {
  if (!EmulatedClockInUse()) return;
  const int64_t ns = ToNs(t);
  int64_t seen = last_ready_ns.load(std::memory_order_relaxed);
  while (seen < ns && !last_ready_ns.compare_exchange_weak(seen, ns, std::memory_order_relaxed)) {
  }
}

EmulatedClock::time_point DeviceStart(EmulatedClock::time_point now) {
  in_use.store(true, std::memory_order_relaxed);
  const int64_t last = last_ready_ns.load(std::memory_order_relaxed);
  const int64_t now_ns = ToNs(now);
  const int64_t window_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(kLaunchWindow).count();
  if (last <= now_ns && last >= now_ns - window_ns) {  // no overflow at INT64_MIN
    return EmulatedClock::time_point(std::chrono::duration_cast<EmulatedClock::duration>(
        std::chrono::nanoseconds(last)));
  }
  return now;
}

}  // namespace prophet_tf
