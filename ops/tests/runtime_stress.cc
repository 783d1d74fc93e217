// Concurrency stress test of the prophet_tf runtime (ops/runtime.cc).
//
// Many threads mix every runtime entry point for a bounded time, in phases:
// each phase ends at a barrier where the invariants that need a quiet runtime
// are checked, then prophet_reset runs with no other call in flight (the API
// lets gradient data die at a reset, so a reset must not race with readers).
// Anything wrong prints "runtime_stress: VIOLATION: ..." and the exit code is 1.
//
// Build and run with ops/tests/build_stress.py (plain, asan or tsan); setup.py
// leaves ops/tests/ out of the op library.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "runtime.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/cancellation.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"

namespace {

using tensorflow::CancellationManager;
using tensorflow::PartialTensorShape;
using tensorflow::Tensor;
using tensorflow::TensorShape;

constexpr uint64_t kDefaultSeed = 20240611;
constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();
constexpr int32_t kCallerStampKind = 16;  // 16..19: prophet_stamp from workers
constexpr int32_t kBenchStampKind = 40;   // prophet_stamp_benchmark records
constexpr int kMaxHeldGrads = 8;
constexpr int64_t kMaxQueuedGrads = 256;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// ---------------------------------------------------------------------------
// Violations.

std::atomic<int64_t> g_violations{0};
std::mutex g_print_mu;

void Violation(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void Violation(const char* fmt, ...) {
  const int64_t n = g_violations.fetch_add(1) + 1;
  if (n > 50) return;  // the first ones are the useful ones
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  std::lock_guard<std::mutex> lock(g_print_mu);
  std::fprintf(stderr, "runtime_stress: VIOLATION: %s\n", buf);
  std::fflush(stderr);
}

// ---------------------------------------------------------------------------
// Random numbers: one generator per thread, seeded from --seed.

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL) {}
  uint64_t Next() {  // splitmix64
    uint64_t z = (s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  int64_t Uniform(int64_t n) { return n <= 0 ? 0 : static_cast<int64_t>(Next() % static_cast<uint64_t>(n)); }
  int64_t Range(int64_t lo, int64_t hi) { return lo + Uniform(hi - lo + 1); }  // inclusive
  bool Chance(double p) { return static_cast<double>(Next() >> 11) * 0x1.0p-53 < p; }
};

// ---------------------------------------------------------------------------
// Parameters and byte patterns.

struct Spec {
  int64_t key;
  std::vector<int64_t> dims;
  TensorShape shape;
  int64_t nbytes;
  // Commits race the writes (PROPHET_ERR_BUSY), so a value may be published
  // half written: readers check that it never changes afterwards instead of
  // checking its bytes.
  bool racy;
};

std::vector<Spec> g_specs;
constexpr int64_t kUndeclaredKey = 424242;

void InitSpecs() {
  const std::vector<std::vector<int64_t>> shapes = {{}, {7}, {3, 0}, {5, 3, 2}, {64, 33}, {64, 1024}, {512, 512}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    Spec s;
    s.key = 101 + static_cast<int64_t>(i);
    s.dims = shapes[i];
    s.racy = i + 1 == shapes.size();
    s.shape = TensorShape(s.dims);
    s.nbytes = s.shape.num_elements() * static_cast<int64_t>(sizeof(float));
    g_specs.push_back(s);
  }
}

int NumSpecs() { return static_cast<int>(g_specs.size()); }

uint32_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// Word j of parameter `key` at `version`: the version can be read back from
// word 0, and every other word is checked against it, so a torn value, a value
// mixing two versions or a stray write shows up.
uint32_t ParamWord(int64_t key, int64_t version, int64_t j) {
  return static_cast<uint32_t>(version) ^ Mix(static_cast<uint64_t>(key) * 0x100000001B3ULL + j);
}

uint32_t GradWord(int64_t key, int64_t step, int64_t j) {
  return static_cast<uint32_t>(step) ^ Mix(~static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ULL + j);
}

template <typename WordFn>
void FillBytes(WordFn word, int64_t offset, int64_t n, char* out) {
  for (int64_t i = 0; i < n;) {
    const int64_t pos = offset + i;
    const uint32_t w = word(pos >> 2);
    const int64_t lane = pos & 3;
    const int64_t take = std::min<int64_t>(4 - lane, n - i);
    std::memcpy(out + i, reinterpret_cast<const char*>(&w) + lane, static_cast<size_t>(take));
    i += take;
  }
}

// Returns the first mismatching word index, or -1.
template <typename WordFn>
int64_t FirstBadWord(WordFn word, const char* data, int64_t nbytes) {
  for (int64_t j = 0; j * 4 < nbytes; ++j) {
    uint32_t got;
    std::memcpy(&got, data + 4 * j, 4);
    if (got != word(j)) return j;
  }
  return -1;
}

// Checks a whole parameter value; sets *version from word 0.
bool CheckParamBytes(int64_t key, const char* data, int64_t nbytes, int64_t* version) {
  uint32_t w0;
  std::memcpy(&w0, data, 4);
  *version = static_cast<int64_t>(w0 ^ Mix(static_cast<uint64_t>(key) * 0x100000001B3ULL));
  const int64_t v = *version;
  return FirstBadWord([&](int64_t j) { return ParamWord(key, v, j); }, data, nbytes) < 0;
}

int64_t ReadyNsFor(int64_t step) { return step * 7 + 3; }

// ---------------------------------------------------------------------------
// Shared state. Phase-scoped values are written by the coordinator between
// the two barriers of a phase boundary and only read during a phase.

struct Barrier {
  explicit Barrier(int n) : n_(n) {}
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return gen_ != gen; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int n_;
  int count_ = 0;
  int64_t gen_ = 0;
};

struct KeyState {
  std::atomic<int64_t> issued_version{0};  // across phases: versions only grow
  std::atomic<int64_t> committed_max{-1};  // highest version committed OK this phase
  std::atomic<int64_t> frozen_phase{-1};   // phase in which freeze was called
  int64_t phase_first_version = 1;
};
std::unique_ptr<KeyState[]> g_keys;

std::atomic<int64_t> g_phase{0};
std::atomic<bool> g_phase_stop{false};
std::atomic<bool> g_finished{false};
std::atomic<bool> g_in_reset{false};
std::atomic<int64_t> g_abort_started_phase{-1};
std::atomic<int64_t> g_abort_done_phase{-1};
std::atomic<int64_t> g_abort_done_ns{0};
std::string g_abort_message;  // set between phases

// Phase plan (written between barriers).
bool g_plan_abort = false;
int64_t g_abort_at_ns = 0;
std::atomic<bool> g_abort_claimed{false};
std::atomic<int> g_extra_aborts{0};
bool g_plan_freeze = false;
int g_freeze_spec = 0;
int64_t g_freeze_at_ns = 0;
std::atomic<bool> g_freeze_claimed{false};

bool AbortStarted(int64_t phase) { return g_abort_started_phase.load() == phase; }
bool AbortDone(int64_t phase) { return g_abort_done_phase.load() == phase; }

// Per-phase accounting, checked at the phase boundary.
std::atomic<int64_t> g_enq_count{0}, g_enq_sum{0}, g_enq_xor{0};
std::atomic<int64_t> g_pop_count{0}, g_pop_sum{0}, g_pop_xor{0};
std::atomic<int64_t> g_stamps_recorded{0};  // engine + benchmark records
std::atomic<int64_t> g_commits_ok_phase{0};
std::atomic<int64_t> g_drained_engine{0}, g_drained_deliver{0};
std::atomic<int64_t> g_grad_seq{1};

// Awaits across the whole run.
std::atomic<int64_t> g_awaits_issued{0};
std::atomic<int64_t> g_awaits_completed{0};
std::atomic<int64_t> g_await_id{1};

// Counters for the summary line.
enum Count {
  kOps,
  kEnqueue,
  kEnqueueAborted,
  kNextGrad,
  kNextGradHit,
  kRelease,
  kReleaseBogus,
  kAwait,
  kAwaitOk,
  kAwaitCancelled,
  kAwaitReset,
  kAwaitAborted,
  kAwaitInvalid,
  kCmCancel,
  kBegin,
  kWrite,
  kWriteRejected,
  kBadWrite,
  kCommitOk,
  kCommitFailed,
  kCommitBusy,
  kDeliverCancel,
  kFreeze,
  kStamp,
  kDrain,
  kDrained,
  kAbort,
  kReset,
  kQuery,
  kNumCounts
};
const char* const kCountNames[kNumCounts] = {
    "ops", "enqueue", "enqueue_aborted", "next_grad", "next_grad_hit", "release", "release_bogus",
    "await", "await_ok", "await_cancelled", "await_reset", "await_aborted", "await_invalid",
    "cm_cancel", "deliver_begin", "write", "write_rejected", "bad_write", "commit_ok",
    "commit_failed", "commit_busy", "deliver_cancel", "freeze", "stamp", "drain", "drained_records",
    "abort", "reset", "query"};
std::atomic<int64_t> g_counts[kNumCounts];
void Inc(Count c, int64_t n = 1) { g_counts[c].fetch_add(n, std::memory_order_relaxed); }

const char* CodeName(int rc) {
  switch (rc) {
    case PROPHET_OK: return "OK";
    case PROPHET_ERR_ABORTED: return "ABORTED";
    case PROPHET_ERR_INVALID: return "INVALID";
    case PROPHET_ERR_UNDECLARED: return "UNDECLARED";
    case PROPHET_ERR_VERSION_ORDER: return "VERSION_ORDER";
    case PROPHET_ERR_NO_DELIVERY: return "NO_DELIVERY";
    case PROPHET_ERR_CONFLICT: return "CONFLICT";
    case PROPHET_ERR_BOUNDS: return "BOUNDS";
    case PROPHET_ERR_BUSY: return "BUSY";
    default: return "?";
  }
}

// A failing C call must leave its code and a message in the thread's last error.
void CheckLastError(const char* what, int rc) {
  if (rc >= 0) return;
  if (prophet_last_error_code() != rc) {
    Violation("%s returned %s but prophet_last_error_code()=%d", what, CodeName(rc),
              prophet_last_error_code());
  }
  const char* msg = prophet_last_error();
  if (msg == nullptr || (*msg == '\0' && rc != PROPHET_ERR_ABORTED)) {
    Violation("%s returned %s with an empty prophet_last_error()", what, CodeName(rc));
  }
}

// ---------------------------------------------------------------------------
// AwaitParam bookkeeping.

// A CancellationManager shared by a few awaits. It is deleted by the last of:
// the thread issuing its awaits, the thread that takes it from the pool to
// cancel (or drop) it, and every await callback. So it outlives each
// RegisterCallback, TryDeregisterCallback and StartCancel made on it.
struct CmGroup {
  CancellationManager cm;
  std::atomic<int> refs{0};
  std::atomic<bool> cancel_started{false};
  void Unref() {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }
};

std::mutex g_pool_mu;
std::vector<CmGroup*> g_cm_pool;

void PublishGroup(CmGroup* g) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  g_cm_pool.push_back(g);
}

CmGroup* TakeGroup(Rng* rng) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (g_cm_pool.empty()) return nullptr;
  const size_t i = static_cast<size_t>(rng->Uniform(static_cast<int64_t>(g_cm_pool.size())));
  CmGroup* g = g_cm_pool[i];
  g_cm_pool[i] = g_cm_pool.back();
  g_cm_pool.pop_back();
  return g;
}

void CancelGroup(CmGroup* g) {
  g->cancel_started.store(true);
  g->cm.StartCancel();
  Inc(kCmCancel);
}

enum Expect { kExpectNormal, kExpectInvalidArgument, kExpectFailedPrecondition };

struct AwaitRecord {
  int64_t id;
  int spec;  // index into g_specs; meaningless for kExpectFailedPrecondition
  int64_t key;
  int64_t step;
  int64_t phase;
  int64_t first_version;
  CmGroup* group;
  Expect expect;
  std::atomic<int> calls{0};
  std::atomic<int> outcome{-1};  // absl::StatusCode of the first call
};

void OnAwaitDone(AwaitRecord* r, const absl::Status& status, const Tensor& value) {
  if (r->calls.fetch_add(1) != 0) {
    Violation("AwaitParam callback called twice (key=%lld step=%lld id=%lld, second status: %s)",
              (long long)r->key, (long long)r->step, (long long)r->id, status.ToString().c_str());
    return;  // the first call already released what the record held
  }
  r->outcome.store(static_cast<int>(status.code()));
  if (status.ok()) {
    Inc(kAwaitOk);
    if (r->expect != kExpectNormal) {
      Violation("AwaitParam(key=%lld) expected to fail at once succeeded", (long long)r->key);
    } else {
      const Spec& sp = g_specs[r->spec];
      if (value.dtype() != tensorflow::DT_FLOAT || !value.shape().IsSameSize(sp.shape)) {
        Violation("AwaitParam(key=%lld) value is %s%s, declared float%s", (long long)r->key,
                  tensorflow::DataTypeString(value.dtype()).c_str(), value.shape().DebugString().c_str(),
                  sp.shape.DebugString().c_str());
      } else if (sp.nbytes > 0 && !sp.racy) {
        const auto data = value.tensor_data();
        int64_t v = -1;
        if (static_cast<int64_t>(data.size()) != sp.nbytes) {
          Violation("AwaitParam(key=%lld) value has %zu bytes, expected %lld", (long long)r->key,
                    data.size(), (long long)sp.nbytes);
        } else if (!CheckParamBytes(r->key, data.data(), sp.nbytes, &v)) {
          Violation("AwaitParam(key=%lld, step=%lld) value bytes are not one committed version "
                    "(word 0 says version %lld)",
                    (long long)r->key, (long long)r->step, (long long)v);
        } else {
          const KeyState& ks = g_keys[r->spec];
          if (v < r->first_version) {
            Violation("AwaitParam(key=%lld) got version %lld from before the last reset (phase starts at %lld)",
                      (long long)r->key, (long long)v, (long long)r->first_version);
          }
          if (v > ks.issued_version.load()) {
            Violation("AwaitParam(key=%lld) got version %lld that was never delivered", (long long)r->key,
                      (long long)v);
          }
          if (v < r->step && ks.frozen_phase.load() != r->phase) {
            Violation("AwaitParam(key=%lld, step=%lld) succeeded with version %lld < step (not frozen)",
                      (long long)r->key, (long long)r->step, (long long)v);
          }
        }
      }
    }
  } else {
    if (value.IsInitialized() && value.NumElements() != 0) {
      Violation("failed AwaitParam(key=%lld) passed a non-empty value", (long long)r->key);
    }
    switch (status.code()) {
      case absl::StatusCode::kCancelled:
        if (absl::StrContains(status.message(), "reset")) {
          Inc(kAwaitReset);
          if (!g_in_reset.load()) {
            Violation("AwaitParam(key=%lld) failed with a reset outside prophet_reset: %s",
                      (long long)r->key, status.ToString().c_str());
          }
        } else {
          Inc(kAwaitCancelled);
          if (r->group == nullptr || !r->group->cancel_started.load()) {
            Violation("AwaitParam(key=%lld) cancelled without a cancelled manager: %s", (long long)r->key,
                      status.ToString().c_str());
          }
        }
        break;
      case absl::StatusCode::kAborted:
        Inc(kAwaitAborted);
        if (!AbortStarted(r->phase)) {
          Violation("AwaitParam(key=%lld) aborted without prophet_abort: %s", (long long)r->key,
                    status.ToString().c_str());
        } else if (!absl::StrContains(status.message(), g_abort_message)) {
          Violation("AwaitParam abort status lacks the abort message: %s", status.ToString().c_str());
        }
        break;
      case absl::StatusCode::kInvalidArgument:
        Inc(kAwaitInvalid);
        if (r->expect != kExpectInvalidArgument) {
          Violation("AwaitParam(key=%lld) unexpected InvalidArgument: %s", (long long)r->key,
                    status.ToString().c_str());
        }
        break;
      case absl::StatusCode::kFailedPrecondition:
        Inc(kAwaitInvalid);
        if (r->expect != kExpectFailedPrecondition) {
          Violation("AwaitParam(key=%lld) unexpected FailedPrecondition: %s", (long long)r->key,
                    status.ToString().c_str());
        }
        break;
      default:
        Violation("AwaitParam(key=%lld) unexpected status %s", (long long)r->key, status.ToString().c_str());
    }
  }
  CmGroup* g = r->group;
  g_awaits_completed.fetch_add(1);
  if (g != nullptr) g->Unref();
}

// ---------------------------------------------------------------------------
// Deliveries.

enum DeliveryMode { kCommit, kCancelAfterWrites, kCancelDuringWrites, kCommitRacingWrites };

struct DeliveryState {
  int spec;
  int64_t key;
  int64_t version;
  DeliveryMode mode;
  std::atomic<int> remaining{0};     // good writes still to run
  std::atomic<bool> closing{false};  // set before the cancel/commit that ends it
  // kCommitRacingWrites: the value published by the commit and a copy of its
  // bytes taken right after, compared once every write has returned.
  Tensor published;
  std::vector<char> snapshot;
  bool have_snapshot = false;
  int pieces = 0;
  std::atomic<int> writes_started{0}, writes_done{0};
};

enum BadWrite {
  kGood = -1,
  kBadNegOffset,
  kBadNegBytes,
  kBadPastEnd,
  kBadOffsetPastEndZero,
  kBadOffsetMax,
  kBadBytesMax,
  kBadBothMax,
  kBadOffsetMin,
  kBadBytesMin,
  kBadWrongVersion,
  kBadNegVersion,
  kBadUndeclared,
  kBadNullSrc,
  kZeroAtEnd,  // valid: nothing to write
  kNumBadWrites
};

struct WriteTask {
  std::shared_ptr<DeliveryState> d;
  int64_t offset;
  int64_t nbytes;
  int bad;
};

std::mutex g_task_mu;
std::deque<WriteTask> g_tasks;

void PushTasks(std::vector<WriteTask>* tasks) {
  std::lock_guard<std::mutex> lock(g_task_mu);
  for (auto& t : *tasks) g_tasks.push_back(std::move(t));
}

bool PopTask(WriteTask* t) {
  std::lock_guard<std::mutex> lock(g_task_mu);
  if (g_tasks.empty()) return false;
  *t = std::move(g_tasks.front());
  g_tasks.pop_front();
  return true;
}

// Poison: a bad write that copied anything would leave 0xEE bytes in a value.
char g_poison[64];

void FetchMax(std::atomic<int64_t>* a, int64_t v) {
  int64_t cur = a->load();
  while (cur < v && !a->compare_exchange_weak(cur, v)) {
  }
}

// ---------------------------------------------------------------------------
// Worker.

struct HeldGrad {
  ProphetGradInfo info;
  bool stale;  // handed out before the last reset: data is gone, only release
};

class Worker {
 public:
  Worker(int index, uint64_t seed) : index_(index), rng_(seed ^ (0xA5A5A5A5ULL * (index + 1))) {}

  void Run(Barrier* barrier) {
    for (;;) {
      barrier->Wait();  // the coordinator has set the phase up
      if (g_finished.load()) break;
      StartPhase();
      while (!g_phase_stop.load(std::memory_order_acquire)) {
        OneOp();
        Inc(kOps);
      }
      EndPhase();
      barrier->Wait();  // quiet: the coordinator checks and resets
    }
    for (HeldGrad& h : held_) prophet_release_grad(h.info.handle);
    held_.clear();
  }

  int64_t HeldLive() const {
    int64_t n = 0;
    for (const HeldGrad& h : held_) n += h.stale ? 0 : 1;
    return n;
  }

  void MarkHeldStale() {
    for (HeldGrad& h : held_) h.stale = true;
  }

 private:
  void StartPhase() {
    phase_ = g_phase.load();
    last_version_.assign(g_specs.size(), -1);
    last_seq_seen_.assign(4096, -1);
    last_t_seen_ = 0;
    stamp_seq_ = 0;
  }

  void EndPhase() {
    // Re-read every held gradient: data must stay valid until release, even
    // across an abort. Keep some across the reset to release them afterwards.
    std::vector<HeldGrad> keep;
    for (HeldGrad& h : held_) {
      if (!h.stale) VerifyGrad(h.info, "held at phase end");
      if (h.stale || rng_.Chance(0.5)) {
        prophet_release_grad(h.info.handle);
        Inc(kRelease);
      } else {
        keep.push_back(h);
      }
    }
    held_.swap(keep);
  }

  void OneOp() {
    MaybePlannedEvents();
    const int64_t r = rng_.Uniform(1000);
    if (r < 90) return Enqueue();
    if (r < 210) return NextGrad();
    if (r < 280) return Release();
    if (r < 420) return Await();
    if (r < 460) return CancelSomeGroup();
    if (r < 520) return Deliver();
    if (r < 740) {
      if (RunWriteTask()) return;
      return Deliver();
    }
    if (r < 770) return DirectBadCalls();
    if (r < 850) return Stamp();
    if (r < 875) return Drain();
    if (r < 990) return Query();
    return MaybeExtraAbort();
  }

  void MaybePlannedEvents() {
    if (g_plan_abort && !g_abort_claimed.load(std::memory_order_relaxed) && NowNs() >= g_abort_at_ns) {
      bool expected = false;
      if (g_abort_claimed.compare_exchange_strong(expected, true)) {
        g_abort_started_phase.store(phase_);
        prophet_abort(g_abort_message.c_str());
        g_abort_done_ns.store(NowNs());
        g_abort_done_phase.store(phase_);
        Inc(kAbort);
      }
    }
    if (g_plan_freeze && !g_freeze_claimed.load(std::memory_order_relaxed) && NowNs() >= g_freeze_at_ns) {
      bool expected = false;
      if (g_freeze_claimed.compare_exchange_strong(expected, true)) {
        g_keys[g_freeze_spec].frozen_phase.store(phase_);
        const int rc = prophet_freeze_param(g_specs[g_freeze_spec].key);
        if (rc != PROPHET_OK) Violation("prophet_freeze_param(declared key) = %s", CodeName(rc));
        Inc(kFreeze);
      }
    }
  }

  void MaybeExtraAbort() {
    // A second abort must keep the first message and fail nothing new.
    if (AbortDone(phase_) && g_extra_aborts.fetch_add(1) < 3) {
      prophet_abort("second abort");
      Inc(kAbort);
      int rc = prophet_deliver_begin(g_specs[0].key, kI64Max / 2);
      if (rc != PROPHET_ERR_ABORTED) Violation("deliver_begin after abort = %s", CodeName(rc));
      if (!absl::StrContains(prophet_last_error(), g_abort_message)) {
        Violation("abort message changed by a second prophet_abort: '%s'", prophet_last_error());
      }
      return;
    }
    Query();
  }

  // The racy parameter is large: pick it now and then, never for gradients.
  int RandomSpec(bool allow_racy = true) {
    const int last = NumSpecs() - 1;
    if (allow_racy && rng_.Chance(0.04)) return last;
    return static_cast<int>(rng_.Uniform(last));
  }

  // --- gradients

  void Enqueue() {
    if (prophet_queued_grads() > kMaxQueuedGrads) return NextGrad();
    const int s = RandomSpec(false);
    const Spec& sp = g_specs[s];
    const int64_t step = g_grad_seq.fetch_add(1);
    const bool after_abort = AbortDone(phase_);
    absl::Status st;
    {
      Tensor t(tensorflow::DT_FLOAT, sp.shape);
      if (sp.nbytes > 0) {
        char* p = const_cast<char*>(t.tensor_data().data());
        FillBytes([&](int64_t j) { return GradWord(sp.key, step, j); }, 0, sp.nbytes, p);
      }
      st = prophet_tf::EnqueueGrad(sp.key, step, t, ReadyNsFor(step));
    }  // the runtime now holds the only reference
    Inc(kEnqueue);
    if (st.ok()) {
      if (after_abort) Violation("EnqueueGrad succeeded after prophet_abort returned");
      g_enq_count.fetch_add(1);
      g_enq_sum.fetch_add(step);
      g_enq_xor.fetch_xor(step);
    } else if (st.code() == absl::StatusCode::kAborted && AbortStarted(phase_)) {
      Inc(kEnqueueAborted);
    } else {
      Violation("EnqueueGrad: %s", st.ToString().c_str());
    }
  }

  void NextGrad() {
    if (held_.size() >= kMaxHeldGrads) return Release();
    static const int64_t kTimeouts[] = {0, 0, 50, 200, 1000};
    const int64_t timeout = kTimeouts[rng_.Uniform(5)];
    const bool after_abort = AbortDone(phase_);
    ProphetGradInfo info;
    std::memset(&info, 0x5A, sizeof(info));
    const int rc = prophet_next_grad(timeout, &info);
    Inc(kNextGrad);
    if (rc == 1) {
      Inc(kNextGradHit);
      if (after_abort) Violation("prophet_next_grad returned a gradient after prophet_abort returned");
      VerifyGrad(info, "just popped");
      g_pop_count.fetch_add(1);
      g_pop_sum.fetch_add(info.step);
      g_pop_xor.fetch_xor(info.step);
      held_.push_back(HeldGrad{info, false});
    } else if (rc == 0) {
      if (after_abort) Violation("prophet_next_grad returned 0 after prophet_abort returned");
    } else if (rc == PROPHET_ERR_ABORTED && AbortStarted(phase_)) {
      CheckLastError("prophet_next_grad", rc);
    } else {
      Violation("prophet_next_grad = %d (%s)", rc, CodeName(rc));
    }
    if (rng_.Chance(0.01)) {
      const int bad = prophet_next_grad(0, nullptr);
      if (bad != PROPHET_ERR_INVALID) Violation("prophet_next_grad(NULL) = %s", CodeName(bad));
      CheckLastError("prophet_next_grad(NULL)", bad);
    }
  }

  void VerifyGrad(const ProphetGradInfo& info, const char* when) {
    const int s = SpecIndex(info.key);
    if (s < 0) {
      Violation("gradient (%s) has unknown key %lld", when, (long long)info.key);
      return;
    }
    const Spec& sp = g_specs[s];
    if (info.dtype != tensorflow::DT_FLOAT || info.nbytes != sp.nbytes || info.reserved != 0 ||
        info.ready_ns != ReadyNsFor(info.step) || info.step <= 0 || info.step >= g_grad_seq.load() ||
        info.handle <= 0 || info.data == nullptr) {
      Violation("gradient (%s) has bad fields: key=%lld step=%lld dtype=%d nbytes=%lld handle=%lld ready_ns=%lld",
                when, (long long)info.key, (long long)info.step, info.dtype, (long long)info.nbytes,
                (long long)info.handle, (long long)info.ready_ns);
      return;
    }
    const int64_t bad = FirstBadWord([&](int64_t j) { return GradWord(info.key, info.step, j); },
                                     static_cast<const char*>(info.data), info.nbytes);
    if (bad >= 0) {
      Violation("gradient (%s) key=%lld step=%lld: word %lld differs from what was enqueued", when,
                (long long)info.key, (long long)info.step, (long long)bad);
    }
  }

  void Release() {
    Inc(kRelease);
    const int64_t r = rng_.Uniform(10);
    if (r < 2 || held_.empty()) {
      // Handles nobody holds: must be ignored.
      static const int64_t kBogus[] = {0, -1, kI64Max, kI64Min};
      prophet_release_grad(r == 1 && last_released_ > 0 ? last_released_ : kBogus[rng_.Uniform(4)]);
      Inc(kReleaseBogus);
      return;
    }
    const size_t i = static_cast<size_t>(rng_.Uniform(static_cast<int64_t>(held_.size())));
    HeldGrad h = held_[i];
    held_[i] = held_.back();
    held_.pop_back();
    if (!h.stale) VerifyGrad(h.info, "before release");
    prophet_release_grad(h.info.handle);
    if (rng_.Chance(0.2)) {
      prophet_release_grad(h.info.handle);  // double release
      Inc(kReleaseBogus);
    }
    last_released_ = h.info.handle;
  }

  // --- awaits

  void Await() {
    const int n = static_cast<int>(rng_.Range(1, 3));
    CmGroup* group = nullptr;
    bool published = false;
    if (rng_.Chance(0.6)) {
      group = new CmGroup;
      group->refs.store(2);  // this thread + whoever takes it from the pool
      if (rng_.Chance(0.5)) {
        PublishGroup(group);  // may be cancelled while the awaits register
        published = true;
      }
    }
    for (int i = 0; i < n; ++i) IssueAwait(group);
    if (group != nullptr) {
      if (!published) PublishGroup(group);
      group->Unref();
    }
  }

  void IssueAwait(CmGroup* group) {
    auto rec = std::make_shared<AwaitRecord>();
    rec->id = g_await_id.fetch_add(1);
    rec->spec = RandomSpec();
    const Spec& sp = g_specs[rec->spec];
    KeyState& ks = g_keys[rec->spec];
    rec->key = sp.key;
    rec->phase = phase_;
    rec->first_version = ks.phase_first_version;
    rec->group = group;
    rec->expect = kExpectNormal;
    tensorflow::DataType dtype = tensorflow::DT_FLOAT;
    PartialTensorShape shape(sp.dims);
    const int64_t committed = ks.committed_max.load();
    const int64_t mode = rng_.Uniform(100);
    if (mode < 4) {
      rec->expect = kExpectInvalidArgument;
      dtype = tensorflow::DT_DOUBLE;
    } else if (mode < 8) {
      rec->expect = kExpectInvalidArgument;
      std::vector<int64_t> dims(sp.dims.size() + 1, 1);
      shape = PartialTensorShape(dims);
    } else if (mode < 11) {
      rec->expect = kExpectFailedPrecondition;
      rec->key = kUndeclaredKey;
    } else if (mode < 30) {
      std::vector<int64_t> dims = sp.dims;
      for (auto& d : dims) d = rng_.Chance(0.5) ? -1 : d;
      shape = PartialTensorShape(dims);
    } else if (mode < 40) {
      shape = PartialTensorShape();  // unknown rank
    }
    const int64_t base = std::max(committed, ks.phase_first_version);
    const int64_t pick = rng_.Uniform(100);
    if (pick < 5) {
      rec->step = base + 1000000;  // waits until a reset, abort or cancel
    } else if (pick < 10) {
      rec->step = 0;
    } else {
      rec->step = std::max<int64_t>(0, base + rng_.Range(-2, 4));
    }
    if (group != nullptr) group->refs.fetch_add(1);
    g_awaits_issued.fetch_add(1);
    Inc(kAwait);
    AwaitRecord* raw = rec.get();
    prophet_tf::AwaitParam(rec->key, rec->step, dtype, shape, group != nullptr ? &group->cm : nullptr,
                           [rec](const absl::Status& s, const Tensor& v) { OnAwaitDone(rec.get(), s, v); });
    // Requests that fail their checks, or whose version is already committed,
    // must complete before AwaitParam returns.
    if (raw->expect != kExpectNormal && raw->calls.load() != 1) {
      Violation("invalid AwaitParam(key=%lld) did not complete inline", (long long)raw->key);
    }
    if (raw->expect == kExpectNormal && committed >= 0 && raw->step <= committed) {
      if (raw->calls.load() != 1) {
        Violation("AwaitParam(key=%lld, step=%lld) did not complete inline although version %lld was committed",
                  (long long)raw->key, (long long)raw->step, (long long)committed);
      } else if (raw->outcome.load() != static_cast<int>(absl::StatusCode::kOk) &&
                 !(raw->outcome.load() == static_cast<int>(absl::StatusCode::kAborted) && AbortStarted(phase_))) {
        Violation("AwaitParam(key=%lld, step=%lld) failed (code %d) although version %lld was committed",
                  (long long)raw->key, (long long)raw->step, raw->outcome.load(), (long long)committed);
      }
    }
    if (AbortDone(phase_) && raw->calls.load() == 0) {
      Violation("AwaitParam(key=%lld) left pending after prophet_abort returned", (long long)raw->key);
    }
  }

  void CancelSomeGroup() {
    CmGroup* g = TakeGroup(&rng_);
    if (g == nullptr) return Await();
    if (rng_.Chance(0.75)) CancelGroup(g);
    g->Unref();
  }

  // --- deliveries

  void Deliver() {
    const int s = RandomSpec();
    const Spec& sp = g_specs[s];
    KeyState& ks = g_keys[s];
    const bool after_abort = AbortDone(phase_);
    auto d = std::make_shared<DeliveryState>();
    d->spec = s;
    d->key = sp.key;
    d->version = ks.issued_version.fetch_add(1) + 1;
    const int64_t m = rng_.Uniform(100);
    d->mode = sp.racy ? kCommitRacingWrites : m < 80 ? kCommit : (m < 90 ? kCancelAfterWrites : kCancelDuringWrites);
    Inc(kBegin);
    int rc = prophet_deliver_begin(d->key, d->version);
    if (rc == PROPHET_OK && rng_.Chance(0.1)) rc = prophet_deliver_begin(d->key, d->version);  // idempotent
    if (rc != PROPHET_OK) {
      CheckLastError("prophet_deliver_begin", rc);
      const bool ok = (rc == PROPHET_ERR_ABORTED && AbortStarted(phase_)) ||
                      (rc == PROPHET_ERR_VERSION_ORDER && !after_abort &&
                       prophet_param_version(d->key) > d->version);
      if (!ok) Violation("prophet_deliver_begin(key=%lld, v=%lld) = %s", (long long)d->key,
                         (long long)d->version, CodeName(rc));
      return;
    }
    if (after_abort) Violation("prophet_deliver_begin succeeded after prophet_abort returned");
    // Split into disjoint byte ranges (unaligned on purpose), written by
    // whichever workers pick them up, with bad writes mixed in.
    std::vector<int64_t> cuts = {0, sp.nbytes};
    const int64_t pieces = rng_.Range(1, 6);
    for (int64_t i = 1; i < pieces && sp.nbytes > 1; ++i) cuts.push_back(rng_.Range(1, sp.nbytes - 1));
    std::sort(cuts.begin(), cuts.end());
    std::vector<WriteTask> tasks;
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      tasks.push_back(WriteTask{d, cuts[i], cuts[i + 1] - cuts[i], kGood});
    }
    const int nbad = static_cast<int>(rng_.Uniform(3));
    for (int i = 0; i < nbad; ++i) {
      tasks.push_back(WriteTask{d, 0, 0, static_cast<int>(rng_.Uniform(kNumBadWrites))});
    }
    for (size_t i = tasks.size(); i > 1; --i) std::swap(tasks[i - 1], tasks[rng_.Uniform(i)]);
    // For a cancel or commit during the writes, this thread counts as one
    // more write, so that what follows the last write comes after it.
    const bool cancel_now = d->mode == kCancelDuringWrites;
    const bool commit_now = d->mode == kCommitRacingWrites;
    d->pieces = static_cast<int>(cuts.size() - 1);
    d->remaining.store(d->pieces + (cancel_now || commit_now ? 1 : 0));
    PushTasks(&tasks);
    if (commit_now) {
      CommitRacingWrites(d);
      if (d->remaining.fetch_sub(1) == 1) Finish(d);
    }
    if (cancel_now) {
      d->closing.store(true);
      rc = prophet_deliver_cancel(d->key, d->version);
      Inc(kDeliverCancel);
      if (rc != PROPHET_OK) Violation("prophet_deliver_cancel(open delivery) = %s", CodeName(rc));
      if (d->remaining.fetch_sub(1) == 1) Finish(d);
    }
  }

  bool RunWriteTask() {
    WriteTask t;
    if (!PopTask(&t)) return false;
    DeliveryState& d = *t.d;
    if (t.bad != kGood) {
      BadWriteCall(d, t.bad);
      return true;
    }
    buf_.resize(static_cast<size_t>(std::max<int64_t>(t.nbytes, 1)));
    FillBytes([&](int64_t j) { return ParamWord(d.key, d.version, j); }, t.offset, t.nbytes, buf_.data());
    const bool after_abort = AbortDone(phase_);
    d.writes_started.fetch_add(1);
    const int rc = prophet_deliver_write(d.key, d.version, t.offset, buf_.data(), t.nbytes);
    d.writes_done.fetch_add(1);
    Inc(kWrite);
    if (rc != PROPHET_OK) {
      Inc(kWriteRejected);
      CheckLastError("prophet_deliver_write", rc);
      const bool ok = (rc == PROPHET_ERR_ABORTED && AbortStarted(phase_)) ||
                      (rc == PROPHET_ERR_NO_DELIVERY && d.closing.load());
      if (!ok) {
        Violation("prophet_deliver_write(key=%lld, v=%lld, off=%lld, n=%lld) = %s", (long long)d.key,
                  (long long)d.version, (long long)t.offset, (long long)t.nbytes, CodeName(rc));
      }
    } else if (after_abort && t.nbytes > 0) {
      Violation("prophet_deliver_write succeeded after prophet_abort returned");
    }
    if (d.remaining.fetch_sub(1) == 1) Finish(t.d);
    return true;
  }

  // Commits while other workers may be writing: BUSY until no write is in
  // flight. Once the commit succeeds no write may land in the value.
  void CommitRacingWrites(const std::shared_ptr<DeliveryState>& dp) {
    DeliveryState& d = *dp;
    d.closing.store(true);
    // Aim at a write in progress, but never wait long: the tasks may be
    // dropped at the end of the phase.
    const int64_t until = NowNs() + 2000000;
    while (NowNs() < until && d.writes_done.load() < d.pieces &&
           d.writes_started.load() == d.writes_done.load()) {
      std::this_thread::yield();
    }
    int rc = PROPHET_ERR_BUSY;
    for (int attempt = 0; attempt < 100000; ++attempt) {
      rc = prophet_deliver_commit(d.key, d.version);
      if (rc != PROPHET_ERR_BUSY) break;
      Inc(kCommitBusy);
      CheckLastError("prophet_deliver_commit (busy)", rc);
      std::this_thread::yield();
    }
    if (rc == PROPHET_ERR_BUSY) {
      Violation("prophet_deliver_commit(key=%lld, v=%lld) still BUSY after 100000 attempts", (long long)d.key,
                (long long)d.version);
      prophet_deliver_cancel(d.key, d.version);
      return;
    }
    if (rc != PROPHET_OK) {
      Inc(kCommitFailed);
      CheckLastError("prophet_deliver_commit (racing)", rc);
      const bool ok = (rc == PROPHET_ERR_ABORTED && AbortStarted(phase_)) ||
                      (rc == PROPHET_ERR_VERSION_ORDER && prophet_param_version(d.key) > d.version);
      if (!ok) Violation("prophet_deliver_commit(key=%lld, v=%lld) racing writes = %s", (long long)d.key,
                         (long long)d.version, CodeName(rc));
      return;
    }
    Inc(kCommitOk);
    FetchMax(&g_keys[d.spec].committed_max, d.version);
    g_commits_ok_phase.fetch_add(1);
    Tensor value;
    bool got = false;
    g_awaits_issued.fetch_add(1);
    g_awaits_completed.fetch_add(1);  // completes inline; not an AwaitRecord
    prophet_tf::AwaitParam(d.key, d.version, tensorflow::DT_FLOAT, PartialTensorShape(g_specs[d.spec].dims), nullptr,
                           [&](const absl::Status& s, const Tensor& v) {
                             if (s.ok()) value = v;
                             got = s.ok() || s.code() == absl::StatusCode::kAborted;
                           });
    if (!got) {
      Violation("AwaitParam(key=%lld, step=%lld) right after its commit did not succeed inline", (long long)d.key,
                (long long)d.version);
      return;
    }
    if (!value.IsInitialized()) return;  // aborted meanwhile
    const auto bytes = value.tensor_data();
    d.snapshot.assign(bytes.data(), bytes.data() + bytes.size());
    d.published = value;
    d.have_snapshot = true;
  }

  void Finish(const std::shared_ptr<DeliveryState>& dp) {
    DeliveryState& d = *dp;
    KeyState& ks = g_keys[d.spec];
    if (d.mode == kCommitRacingWrites) {
      // Every write has returned: the published value must be as it was.
      if (d.have_snapshot) {
        const auto bytes = d.published.tensor_data();
        if (bytes.size() != d.snapshot.size() || std::memcmp(bytes.data(), d.snapshot.data(), bytes.size()) != 0) {
          Violation("key=%lld: a value changed after its commit returned OK (a write landed in it)",
                    (long long)d.key);
        }
      }
      return;
    }
    if (d.mode == kCancelAfterWrites) {
      d.closing.store(true);
      const int rc = prophet_deliver_cancel(d.key, d.version);
      Inc(kDeliverCancel);
      if (rc != PROPHET_OK) Violation("prophet_deliver_cancel(open delivery) = %s", CodeName(rc));
    }
    d.closing.store(true);
    const bool after_abort = AbortDone(phase_);
    const int rc = prophet_deliver_commit(d.key, d.version);
    if (rc == PROPHET_OK) {
      Inc(kCommitOk);
      if (d.mode != kCommit) Violation("prophet_deliver_commit of a cancelled delivery succeeded");
      if (after_abort) Violation("prophet_deliver_commit succeeded after prophet_abort returned");
      FetchMax(&ks.committed_max, d.version);
      g_commits_ok_phase.fetch_add(1);
      VerifyCommitted(d);
      return;
    }
    Inc(kCommitFailed);
    CheckLastError("prophet_deliver_commit", rc);
    bool ok = rc == PROPHET_ERR_ABORTED && AbortStarted(phase_);
    if (!after_abort) {
      if (rc == PROPHET_ERR_VERSION_ORDER) ok = ok || prophet_param_version(d.key) > d.version;
      if (rc == PROPHET_ERR_NO_DELIVERY) ok = ok || d.mode != kCommit;
    }
    if (!ok) {
      Violation("prophet_deliver_commit(key=%lld, v=%lld, mode=%d) = %s", (long long)d.key,
                (long long)d.version, d.mode, CodeName(rc));
    }
  }

  // Right after a successful commit the value is readable at once.
  void VerifyCommitted(const DeliveryState& d) {
    auto rec = std::make_shared<AwaitRecord>();
    rec->id = g_await_id.fetch_add(1);
    rec->spec = d.spec;
    rec->key = d.key;
    rec->step = d.version;
    rec->phase = phase_;
    rec->first_version = g_keys[d.spec].phase_first_version;
    rec->group = nullptr;
    rec->expect = kExpectNormal;
    g_awaits_issued.fetch_add(1);
    Inc(kAwait);
    prophet_tf::AwaitParam(d.key, d.version, tensorflow::DT_FLOAT, PartialTensorShape(g_specs[d.spec].dims),
                           nullptr, [rec](const absl::Status& s, const Tensor& v) { OnAwaitDone(rec.get(), s, v); });
    const int outcome = rec->outcome.load();
    if (rec->calls.load() != 1) {
      Violation("AwaitParam(key=%lld, step=%lld) right after its commit did not complete inline",
                (long long)d.key, (long long)d.version);
    } else if (outcome != static_cast<int>(absl::StatusCode::kOk) &&
               !(outcome == static_cast<int>(absl::StatusCode::kAborted) && AbortStarted(phase_))) {
      Violation("AwaitParam(key=%lld, step=%lld) right after its commit failed (code %d)", (long long)d.key,
                (long long)d.version, outcome);
    }
  }

  // Each bad write must return its code and copy nothing (its source is
  // poison, and the readers check every byte of every value).
  void BadWriteCall(DeliveryState& d, int kind) {
    const int64_t size = g_specs[d.spec].nbytes;
    int64_t key = d.key, version = d.version, offset = 0, nbytes = 1;
    const void* src = g_poison;
    int expected = PROPHET_ERR_BOUNDS;
    switch (kind) {
      case kBadNegOffset: offset = -1; nbytes = 2; break;
      case kBadNegBytes: offset = 0; nbytes = -1; break;
      case kBadPastEnd: offset = std::max<int64_t>(0, size - 2); nbytes = 3; break;
      case kBadOffsetPastEndZero: offset = size + 1; nbytes = 0; break;
      case kBadOffsetMax: offset = kI64Max; nbytes = 1; break;
      case kBadBytesMax: offset = 1; nbytes = kI64Max; break;
      case kBadBothMax: offset = kI64Max; nbytes = kI64Max; break;
      case kBadOffsetMin: offset = kI64Min; nbytes = 8; break;
      case kBadBytesMin: offset = 0; nbytes = kI64Min; break;
      case kBadWrongVersion: version = d.version + (int64_t{1} << 40); expected = PROPHET_ERR_NO_DELIVERY; break;
      case kBadNegVersion: version = -1; expected = PROPHET_ERR_NO_DELIVERY; break;
      case kBadUndeclared: key = kUndeclaredKey; expected = PROPHET_ERR_UNDECLARED; break;
      case kBadNullSrc:
        src = nullptr;
        nbytes = std::min<int64_t>(size, 8);
        expected = size > 0 ? PROPHET_ERR_INVALID : PROPHET_OK;  // 0 bytes: nothing to do
        break;
      case kZeroAtEnd: offset = size; nbytes = 0; src = nullptr; expected = PROPHET_OK; break;
    }
    const bool after_abort = AbortDone(phase_);
    const int rc = prophet_deliver_write(key, version, offset, src, nbytes);
    Inc(kBadWrite);
    CheckLastError("prophet_deliver_write (bad)", rc);
    bool ok = rc == expected;
    if (key != kUndeclaredKey) {
      if (after_abort) {
        ok = rc == PROPHET_ERR_ABORTED;
      } else {
        ok = ok || (rc == PROPHET_ERR_ABORTED && AbortStarted(phase_));
        // A delivery already ended answers NO_DELIVERY before any bounds check.
        ok = ok || (rc == PROPHET_ERR_NO_DELIVERY && d.closing.load());
      }
    }
    if (!ok) {
      Violation("bad prophet_deliver_write kind %d (key=%lld v=%lld off=%lld n=%lld src=%p) = %s, expected %s",
                kind, (long long)key, (long long)version, (long long)offset, (long long)nbytes, src,
                CodeName(rc), CodeName(expected));
    }
  }

  // Calls that must fail whatever else is going on.
  void DirectBadCalls() {
    const int s = RandomSpec();
    const Spec& sp = g_specs[s];
    KeyState& ks = g_keys[s];
    const bool after_abort = AbortDone(phase_);
    auto expect = [&](const char* what, int rc, int want, bool abort_first) {
      CheckLastError(what, rc);
      if (rc == want) {
        if (after_abort && abort_first && want != PROPHET_ERR_ABORTED) {
          Violation("%s = %s after prophet_abort returned", what, CodeName(rc));
        }
        return;
      }
      if (abort_first && rc == PROPHET_ERR_ABORTED && AbortStarted(phase_)) return;
      Violation("%s = %s, expected %s", what, CodeName(rc), CodeName(want));
    };
    Inc(kBadWrite);
    switch (rng_.Uniform(8)) {
      case 0:
        expect("deliver_begin(undeclared)", prophet_deliver_begin(kUndeclaredKey, 1), PROPHET_ERR_UNDECLARED, false);
        break;
      case 1:
        expect("deliver_begin(version -5)", prophet_deliver_begin(sp.key, -5), PROPHET_ERR_INVALID, true);
        break;
      case 2: {
        const int64_t c = ks.committed_max.load();
        if (c >= 1) {
          expect("deliver_begin(older version)", prophet_deliver_begin(sp.key, c - 1), PROPHET_ERR_VERSION_ORDER,
                 true);
        }
        break;
      }
      case 3:
        expect("deliver_commit(never begun)",
               prophet_deliver_commit(sp.key, ks.issued_version.load() + (int64_t{1} << 40)),
               PROPHET_ERR_NO_DELIVERY, true);
        break;
      case 4:
        expect("deliver_cancel(never begun)",
               prophet_deliver_cancel(sp.key, ks.issued_version.load() + (int64_t{1} << 40)),
               PROPHET_ERR_NO_DELIVERY, false);
        break;
      case 5:
        expect("deliver_cancel(undeclared)", prophet_deliver_cancel(kUndeclaredKey, 1), PROPHET_ERR_UNDECLARED,
               false);
        break;
      case 6:
        expect("deliver_write(undeclared)", prophet_deliver_write(kUndeclaredKey, 1, 0, g_poison, 4),
               PROPHET_ERR_UNDECLARED, false);
        break;
      case 7:
        expect("freeze(undeclared)", prophet_freeze_param(kUndeclaredKey), PROPHET_ERR_UNDECLARED, false);
        break;
    }
  }

  // --- stamps

  void Stamp() {
    const int64_t seq = ++stamp_seq_;
    prophet_stamp(index_, seq, kCallerStampKind + static_cast<int32_t>(seq % 4));
    g_stamps_recorded.fetch_add(1);
    Inc(kStamp);
    if (rng_.Chance(0.002)) {
      constexpr int64_t kN = 16;
      if (prophet_stamp_benchmark(kN, kBenchStampKind) < 0) Violation("prophet_stamp_benchmark < 0");
      g_stamps_recorded.fetch_add(kN);
      Inc(kStamp, kN);
    }
  }

  void Drain() {
    const int64_t max = rng_.Range(1, 8192);
    stamps_.resize(static_cast<size_t>(max));
    const int64_t n = prophet_drain_stamps(stamps_.data(), max);
    Inc(kDrain);
    if (n < 0 || n > max) {
      Violation("prophet_drain_stamps(max=%lld) = %lld", (long long)max, (long long)n);
      return;
    }
    Inc(kDrained, n);
    CheckStamps(stamps_.data(), n, &last_seq_seen_, &last_t_seen_);
  }

 public:
  // Records come out in timestamp order, each writer's records in the order
  // it made them, whoever drains them.
  static void CheckStamps(const ProphetStamp* s, int64_t n, std::vector<int64_t>* last_seq, int64_t* last_t) {
    int64_t engine = 0, deliver = 0;
    for (int64_t i = 0; i < n; ++i) {
      const ProphetStamp& r = s[i];
      if (r.t_ns < *last_t) {
        Violation("stamps out of time order: %lld after %lld", (long long)r.t_ns, (long long)*last_t);
      }
      *last_t = r.t_ns;
      if (r.reserved != 0) Violation("stamp reserved field = %d", r.reserved);
      if (r.kind == PROPHET_STAMP_DELIVER) {
        ++deliver;
        const int si = SpecIndex(r.key);
        if (si < 0 || r.step < g_keys[si].phase_first_version || r.step > g_keys[si].issued_version.load()) {
          Violation("DELIVER stamp with key=%lld step=%lld that was never committed this phase",
                    (long long)r.key, (long long)r.step);
        }
      } else if (r.kind >= kCallerStampKind && r.kind < kCallerStampKind + 4) {
        ++engine;
        if (r.key < 0 || r.key >= static_cast<int64_t>(last_seq->size()) ||
            r.kind != kCallerStampKind + static_cast<int32_t>(r.step % 4)) {
          Violation("engine stamp with key=%lld step=%lld kind=%d not recorded as such", (long long)r.key,
                    (long long)r.step, r.kind);
          continue;
        }
        int64_t& last = (*last_seq)[static_cast<size_t>(r.key)];
        if (r.step <= last) {
          Violation("stamps of thread %lld out of order: step %lld after %lld", (long long)r.key,
                    (long long)r.step, (long long)last);
        }
        last = r.step;
      } else if (r.kind == kBenchStampKind) {
        ++engine;
        if (r.step != 0 || r.key < 0 || r.key >= 16) Violation("benchmark stamp key=%lld step=%lld", (long long)r.key,
                                                              (long long)r.step);
      } else {
        Violation("stamp of unexpected kind %d (key=%lld step=%lld)", r.kind, (long long)r.key, (long long)r.step);
      }
    }
    g_drained_engine.fetch_add(engine);
    g_drained_deliver.fetch_add(deliver);
  }

  static int SpecIndex(int64_t key) {
    for (int i = 0; i < NumSpecs(); ++i) {
      if (g_specs[i].key == key) return i;
    }
    return -1;
  }

 private:
  // --- queries

  void Query() {
    Inc(kQuery);
    const int s = RandomSpec();
    const Spec& sp = g_specs[s];
    KeyState& ks = g_keys[s];
    switch (rng_.Uniform(6)) {
      case 0: {
        const int64_t committed = ks.committed_max.load();
        const int64_t v = prophet_param_version(sp.key);
        if (v < committed || v < last_version_[s] || v > ks.issued_version.load() ||
            (v >= 0 && v < ks.phase_first_version) || v < -1) {
          Violation("prophet_param_version(key=%lld) = %lld (committed >= %lld, last seen %lld, first %lld)",
                    (long long)sp.key, (long long)v, (long long)committed, (long long)last_version_[s],
                    (long long)ks.phase_first_version);
        }
        last_version_[s] = std::max(last_version_[s], v);
        break;
      }
      case 1:
        if (prophet_param_nbytes(sp.key) != sp.nbytes || prophet_param_dtype(sp.key) != tensorflow::DT_FLOAT) {
          Violation("param_nbytes/dtype(key=%lld) = %lld/%d", (long long)sp.key,
                    (long long)prophet_param_nbytes(sp.key), prophet_param_dtype(sp.key));
        }
        if (prophet_param_nbytes(kUndeclaredKey) != PROPHET_ERR_UNDECLARED ||
            prophet_param_version(kUndeclaredKey) != PROPHET_ERR_UNDECLARED ||
            prophet_param_dtype(kUndeclaredKey) != PROPHET_ERR_UNDECLARED) {
          Violation("queries on an undeclared key do not return PROPHET_ERR_UNDECLARED");
        }
        break;
      case 2: {
        int rc = prophet_declare_param(sp.key, tensorflow::DT_FLOAT, static_cast<int32_t>(sp.dims.size()),
                                       sp.dims.data());
        if (rc != PROPHET_OK) Violation("re-declaring key=%lld identically = %s", (long long)sp.key, CodeName(rc));
        std::vector<int64_t> other = sp.dims;
        other.push_back(2);
        rc = prophet_declare_param(sp.key, tensorflow::DT_FLOAT, static_cast<int32_t>(other.size()), other.data());
        if (rc != PROPHET_ERR_CONFLICT) Violation("conflicting re-declaration = %s", CodeName(rc));
        CheckLastError("prophet_declare_param(conflict)", rc);
        rc = prophet_declare_param(sp.key, tensorflow::DT_DOUBLE, static_cast<int32_t>(sp.dims.size()),
                                   sp.dims.data());
        if (rc != PROPHET_ERR_CONFLICT) Violation("re-declaration with another dtype = %s", CodeName(rc));
        break;
      }
      case 3: {
        const int64_t neg[] = {3, -1};
        int rc = prophet_declare_param(kUndeclaredKey, tensorflow::DT_INT32, 0, nullptr);
        if (rc != PROPHET_ERR_INVALID) Violation("declare(int32) = %s", CodeName(rc));
        rc = prophet_declare_param(-1, tensorflow::DT_FLOAT, 0, nullptr);
        if (rc != PROPHET_ERR_INVALID) Violation("declare(key -1) = %s", CodeName(rc));
        rc = prophet_declare_param(kUndeclaredKey, tensorflow::DT_FLOAT, 2, neg);
        if (rc != PROPHET_ERR_INVALID) Violation("declare(negative dim) = %s", CodeName(rc));
        rc = prophet_declare_param(kUndeclaredKey, tensorflow::DT_FLOAT, 2, nullptr);
        if (rc != PROPHET_ERR_INVALID) Violation("declare(dims NULL) = %s", CodeName(rc));
        rc = prophet_declare_param(kUndeclaredKey, tensorflow::DT_FLOAT, -1, nullptr);
        if (rc != PROPHET_ERR_INVALID) Violation("declare(ndims -1) = %s", CodeName(rc));
        CheckLastError("prophet_declare_param(bad)", rc);
        break;
      }
      case 4:
        if (prophet_pending_awaits() < 0 || prophet_queued_grads() < 0) Violation("negative pending/queued count");
        if (prophet_outstanding_grads() < HeldLive()) {
          Violation("prophet_outstanding_grads() = %lld < %lld held by one thread",
                    (long long)prophet_outstanding_grads(), (long long)HeldLive());
        }
        break;
      case 5:
        if (prophet_stamp_capacity() <= 0 || prophet_stamps_dropped() < 0 || prophet_now_ns() <= 0) {
          Violation("bad stamp capacity/dropped/now");
        }
        break;
    }
  }

  const int index_;
  Rng rng_;
  int64_t phase_ = 0;
  std::vector<HeldGrad> held_;
  int64_t last_released_ = 0;
  std::vector<char> buf_;
  std::vector<ProphetStamp> stamps_;
  std::vector<int64_t> last_version_;
  std::vector<int64_t> last_seq_seen_;
  int64_t last_t_seen_ = 0;
  int64_t stamp_seq_ = 0;
};

// ---------------------------------------------------------------------------
// Coordinator.

void DeclareAll() {
  for (const Spec& sp : g_specs) {
    const int rc =
        prophet_declare_param(sp.key, tensorflow::DT_FLOAT, static_cast<int32_t>(sp.dims.size()), sp.dims.data());
    if (rc != PROPHET_OK) Violation("prophet_declare_param(key=%lld) = %s", (long long)sp.key, CodeName(rc));
  }
}

void SetUpPhase(int64_t phase, Rng* rng, int64_t phase_ns) {
  g_phase.store(phase);
  for (int i = 0; i < NumSpecs(); ++i) {
    KeyState& ks = g_keys[i];
    ks.phase_first_version = ks.issued_version.load() + 1;
    ks.committed_max.store(-1);
  }
  g_enq_count = g_enq_sum = g_enq_xor = 0;
  g_pop_count = g_pop_sum = g_pop_xor = 0;
  g_stamps_recorded = g_commits_ok_phase = 0;
  g_drained_engine = g_drained_deliver = 0;
  const int64_t start = NowNs();
  g_plan_abort = rng->Chance(0.25);
  g_abort_at_ns = start + phase_ns / 2 + rng->Uniform(phase_ns / 2);
  g_abort_claimed.store(false);
  g_extra_aborts.store(0);
  g_abort_message = "stress abort in phase " + std::to_string(phase);
  g_plan_freeze = rng->Chance(0.4);
  g_freeze_spec = static_cast<int>(rng->Uniform(NumSpecs()));
  g_freeze_at_ns = start + rng->Uniform(phase_ns);
  g_freeze_claimed.store(false);
  g_phase_stop.store(false);
}

// Runs with every worker parked at the barrier.
void EndPhase(int64_t phase, std::vector<std::unique_ptr<Worker>>* workers, Rng* rng) {
  const bool aborted = AbortStarted(phase);
  // Write tasks left over: their deliveries stay open until the reset.
  {
    std::lock_guard<std::mutex> lock(g_task_mu);
    g_tasks.clear();
  }
  // Every await issued and not completed is still listed.
  const int64_t pending = prophet_pending_awaits();
  const int64_t open = g_awaits_issued.load() - g_awaits_completed.load();
  if (pending != open) {
    Violation("phase %lld: prophet_pending_awaits()=%lld but %lld awaits are not completed", (long long)phase,
              (long long)pending, (long long)open);
  }
  // Outstanding gradients are exactly the ones the workers hold.
  int64_t held = 0;
  for (auto& w : *workers) held += w->HeldLive();
  if (prophet_outstanding_grads() != held) {
    Violation("phase %lld: prophet_outstanding_grads()=%lld but workers hold %lld", (long long)phase,
              (long long)prophet_outstanding_grads(), (long long)held);
  }
  // No gradient lost or duplicated (an abort drops the queued ones).
  const int64_t queued = prophet_queued_grads();
  if (aborted && queued != 0) {
    Violation("phase %lld: %lld gradients queued after abort", (long long)phase, (long long)queued);
  }
  ProphetGradInfo info;
  int64_t popped = 0;
  for (;;) {
    const int rc = prophet_next_grad(0, &info);
    if (rc != 1) {
      if (rc != 0 && !(rc == PROPHET_ERR_ABORTED && aborted)) {
        Violation("final prophet_next_grad = %s", CodeName(rc));
      }
      break;
    }
    ++popped;
    g_pop_count.fetch_add(1);
    g_pop_sum.fetch_add(info.step);
    g_pop_xor.fetch_xor(info.step);
    prophet_release_grad(info.handle);
  }
  if (!aborted) {
    if (popped != queued) {
      Violation("phase %lld: queued=%lld but %lld popped", (long long)phase, (long long)queued, (long long)popped);
    }
    if (g_enq_count.load() != g_pop_count.load() || g_enq_sum.load() != g_pop_sum.load() ||
        g_enq_xor.load() != g_pop_xor.load()) {
      Violation("phase %lld: %lld gradients enqueued, %lld popped (sum/xor %s)", (long long)phase,
                (long long)g_enq_count.load(), (long long)g_pop_count.load(),
                g_enq_sum.load() == g_pop_sum.load() && g_enq_xor.load() == g_pop_xor.load() ? "match" : "differ");
    }
  } else if (g_pop_count.load() > g_enq_count.load()) {
    Violation("phase %lld: more gradients popped than enqueued", (long long)phase);
  }
  // Stamps: every record is drained or counted as dropped.
  std::vector<ProphetStamp> buf(4096);
  for (;;) {
    const int64_t n = prophet_drain_stamps(buf.data(), static_cast<int64_t>(buf.size()));
    if (n <= 0) break;
    // Only totals here: the sequence checks need one drainer's full view.
    for (int64_t i = 0; i < n; ++i) {
      if (buf[i].kind == PROPHET_STAMP_DELIVER) g_drained_deliver.fetch_add(1);
      else g_drained_engine.fetch_add(1);
    }
  }
  const int64_t dropped = prophet_stamps_dropped();
  const int64_t made = g_stamps_recorded.load() + g_commits_ok_phase.load();
  const int64_t seen = g_drained_engine.load() + g_drained_deliver.load();
  if (made != seen + dropped) {
    Violation("phase %lld: %lld stamps recorded, %lld drained + %lld dropped", (long long)phase, (long long)made,
              (long long)seen, (long long)dropped);
  }
  if (dropped == 0 && g_drained_deliver.load() != g_commits_ok_phase.load()) {
    Violation("phase %lld: %lld DELIVER stamps for %lld commits", (long long)phase,
              (long long)g_drained_deliver.load(), (long long)g_commits_ok_phase.load());
  }
  // Cancel some of the managers still in the pool before the reset, drop the rest after.
  std::vector<CmGroup*> groups;
  {
    std::lock_guard<std::mutex> lock(g_pool_mu);
    groups.swap(g_cm_pool);
  }
  std::vector<CmGroup*> later;
  for (CmGroup* g : groups) {
    if (rng->Chance(0.5)) {
      CancelGroup(g);
      g->Unref();
    } else {
      later.push_back(g);
    }
  }
  g_in_reset.store(true);
  prophet_reset();
  g_in_reset.store(false);
  Inc(kReset);
  for (CmGroup* g : later) {
    if (rng->Chance(0.5)) CancelGroup(g);  // nothing left to cancel
    g->Unref();
  }
  for (auto& w : *workers) w->MarkHeldStale();
  // After a reset nothing is left.
  if (g_awaits_issued.load() != g_awaits_completed.load()) {
    Violation("after reset: %lld awaits issued, %lld completed", (long long)g_awaits_issued.load(),
              (long long)g_awaits_completed.load());
  }
  if (prophet_pending_awaits() != 0 || prophet_outstanding_grads() != 0 || prophet_queued_grads() != 0 ||
      prophet_stamps_dropped() != 0 || prophet_drain_stamps(buf.data(), 1) != 0) {
    Violation("after reset: pending=%lld outstanding=%lld queued=%lld dropped=%lld",
              (long long)prophet_pending_awaits(), (long long)prophet_outstanding_grads(),
              (long long)prophet_queued_grads(), (long long)prophet_stamps_dropped());
  }
  for (const Spec& sp : g_specs) {
    if (prophet_param_version(sp.key) != PROPHET_ERR_UNDECLARED) {
      Violation("after reset: key=%lld still declared", (long long)sp.key);
    }
  }
  const int rc = prophet_next_grad(0, &info);
  if (rc != 0) Violation("after reset: prophet_next_grad = %s (abort not cleared?)", CodeName(rc));
}

struct Options {
  double seconds = 5;
  int threads = 8;
  uint64_t seed = kDefaultSeed;
};

void Usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--seconds S] [--threads T] [--seed N]\n", argv0);
}

bool ParseArgs(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "runtime_stress: %s needs a value\n", name);
        return nullptr;
      }
      return argv[++i];
    };
    const char* v = nullptr;
    char* end = nullptr;
    if (a == "--seconds") {
      if (!(v = value("--seconds"))) return false;
      o->seconds = std::strtod(v, &end);
      if (*end != '\0' || !(o->seconds > 0)) return false;
    } else if (a == "--threads") {
      if (!(v = value("--threads"))) return false;
      o->threads = static_cast<int>(std::strtol(v, &end, 10));
      if (*end != '\0' || o->threads < 2 || o->threads > 256) return false;
    } else if (a == "--seed") {
      if (!(v = value("--seed"))) return false;
      o->seed = std::strtoull(v, &end, 10);
      if (*end != '\0') return false;
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  if (!ParseArgs(argc, argv, &opt)) {
    Usage(argv[0]);
    return 2;
  }
  // Aborts and resets log warnings; keep the output to what the test reports.
  setenv("PROPHET_TF_LOG_LEVEL", "error", 0);
  // The sanitizers see tensor buffers only when each is its own malloc (the
  // "cpu" allocator); oneDNN's allocator carves large ones out of arenas.
  std::printf("runtime_stress: seed %llu (replay with --seed %llu), %d threads, %.3g s, allocator %s\n",
              (unsigned long long)opt.seed, (unsigned long long)opt.seed, opt.threads, opt.seconds,
              tensorflow::cpu_allocator()->Name().c_str());
  std::fflush(stdout);
  std::memset(g_poison, 0xEE, sizeof(g_poison));
  InitSpecs();
  g_keys.reset(new KeyState[g_specs.size()]);
  prophet_reset();

  Rng rng(opt.seed);
  std::vector<std::unique_ptr<Worker>> workers;
  for (int i = 0; i < opt.threads; ++i) workers.emplace_back(new Worker(i, opt.seed));
  Barrier barrier(opt.threads + 1);
  std::vector<std::thread> threads;
  for (auto& w : workers) threads.emplace_back([&barrier, wp = w.get()] { wp->Run(&barrier); });

  // A deadlock in the runtime would hang the run: fail it instead.
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    int64_t last = -1;
    int idle = 0;
    while (!done.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const int64_t ops = g_counts[kOps].load();
      idle = ops == last ? idle + 1 : 0;
      last = ops;
      if (idle >= 600) {  // 60 s without one operation finishing
        std::fprintf(stderr, "runtime_stress: VIOLATION: no operation finished for 60 s (deadlock?), "
                             "%lld ops so far, seed %llu\n",
                     (long long)ops, (unsigned long long)opt.seed);
        std::fflush(stderr);
        std::_Exit(1);
      }
    }
  });

  const int64_t start = NowNs();
  const int64_t deadline = start + static_cast<int64_t>(opt.seconds * 1e9);
  DeclareAll();
  for (int64_t phase = 1;; ++phase) {
    const int64_t left = deadline - NowNs();
    const int64_t phase_ns = std::max<int64_t>(
        std::min<int64_t>(rng.Range(50, 400) * 1000000, left), 10000000);
    SetUpPhase(phase, &rng, phase_ns);
    barrier.Wait();  // phase starts
    // After an abort every call fails fast; a little of that is enough.
    const int64_t phase_end = NowNs() + phase_ns;
    for (int64_t now = NowNs(); now < phase_end; now = NowNs()) {
      if (AbortDone(phase) && now - g_abort_done_ns.load() > 20000000) break;
      std::this_thread::sleep_for(std::chrono::nanoseconds(std::min<int64_t>(phase_end - now, 2000000)));
    }
    g_phase_stop.store(true, std::memory_order_release);
    barrier.Wait();  // every worker is quiet
    EndPhase(phase, &workers, &rng);
    if (NowNs() >= deadline || g_violations.load() > 0) break;
    DeclareAll();
  }
  g_finished.store(true);
  barrier.Wait();
  for (auto& t : threads) t.join();
  done.store(true);
  watchdog.join();
  prophet_reset();

  const double secs = static_cast<double>(NowNs() - start) / 1e9;
  std::string counts;
  for (int i = 1; i < kNumCounts; ++i) {
    counts += std::string(i == 1 ? "" : " ") + kCountNames[i] + "=" + std::to_string(g_counts[i].load());
  }
  std::printf("runtime_stress: counts: %s\n", counts.c_str());
  const long long ops = (long long)g_counts[kOps].load();
  const int64_t violations = g_violations.load();
  if (violations > 0) {
    std::printf("runtime_stress: %lld operations in %.1f s on %d threads, seed %llu: FAILED (%lld violations)\n",
                ops, secs, opt.threads, (unsigned long long)opt.seed, (long long)violations);
    return 1;
  }
  std::printf("runtime_stress: %lld operations in %.1f s on %d threads, seed %llu: OK\n", ops, secs, opt.threads,
              (unsigned long long)opt.seed);
  return 0;
}
