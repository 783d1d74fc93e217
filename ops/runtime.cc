// Implementation of the per-process runtime declared in runtime.h.

#include "runtime.h"

#include <time.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/types.h"

namespace prophet_tf {
namespace {

using tensorflow::CancellationManager;
using tensorflow::CancellationToken;
using tensorflow::DataType;
using tensorflow::PartialTensorShape;
using tensorflow::Tensor;
using tensorflow::TensorShape;

// ---------------------------------------------------------------------------
// Logging, gated by PROPHET_TF_LOG_LEVEL = debug | info | warning | error.

enum LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

int ConfiguredLogLevel() {
  static const int level = [] {
    const char* env = std::getenv("PROPHET_TF_LOG_LEVEL");
    if (env == nullptr || *env == '\0') return static_cast<int>(kWarning);
    const std::string v = absl::AsciiStrToLower(env);
    if (v == "debug") return static_cast<int>(kDebug);
    if (v == "info") return static_cast<int>(kInfo);
    if (v == "warning") return static_cast<int>(kWarning);
    if (v == "error") return static_cast<int>(kError);
    std::fprintf(stderr,
                 "[prophet_tf native] WARNING: ignoring PROPHET_TF_LOG_LEVEL: expected one of "
                 "debug, info, warning, error. Received: PROPHET_TF_LOG_LEVEL=%s\n",
                 env);
    return static_cast<int>(kWarning);
  }();
  return level;
}

void Log(LogLevel level, const std::string& message) {
  if (level < ConfiguredLogLevel()) return;
  static const char* kNames[] = {"DEBUG", "INFO", "WARNING", "ERROR"};
  std::fprintf(stderr, "[prophet_tf native] %s: %s\n", kNames[level], message.c_str());
}

thread_local std::string last_error;
thread_local int last_error_code = PROPHET_OK;

int Fail(int code, std::string message) {
  last_error = std::move(message);
  last_error_code = code;
  return code;
}

bool IsSupportedDtype(DataType dtype) {
  return dtype == tensorflow::DT_HALF || dtype == tensorflow::DT_BFLOAT16 ||
         dtype == tensorflow::DT_FLOAT || dtype == tensorflow::DT_DOUBLE;
}

// ---------------------------------------------------------------------------
// Stamp buffer: a bounded ring under a mutex held for a few instructions per
// record. Drains copy in chunks so a large drain never stalls writers long.

class StampBuffer {
 public:
  static constexpr int64_t kCapacity = int64_t{1} << 20;  // 32 MiB when full
  static constexpr int64_t kDrainChunk = 4096;

  // Returns the record's timestamp. It is taken under the lock, so records
  // drain in timestamp order even when several threads stamp at once.
  int64_t Record(int64_t key, int64_t step, int32_t kind) {
    int64_t t;
    bool first_drop = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      t = NowNs();
      if (count_ == kCapacity) {
        first_drop = dropped_.fetch_add(1, std::memory_order_relaxed) == 0;
      } else {
        // Allocated on first use; `new T[]` of a POD leaves pages untouched.
        if (!records_) records_.reset(new ProphetStamp[kCapacity]);
        ProphetStamp& s = records_[(head_ + count_) & (kCapacity - 1)];
        s.key = key;
        s.step = step;
        s.t_ns = t;
        s.kind = kind;
        s.reserved = 0;
        ++count_;
      }
    }
    if (first_drop) {
      Log(kWarning, absl::StrCat("stamp buffer full (", kCapacity,
                                 " records); further stamps are dropped until drained"));
    }
    return t;
  }

  int64_t Drain(ProphetStamp* out, int64_t max) {
    int64_t total = 0;
    while (total < max) {
      std::lock_guard<std::mutex> lock(mu_);
      int64_t n = std::min({count_, max - total, kDrainChunk});
      if (n == 0) break;
      const int64_t first = std::min(n, kCapacity - head_);
      std::memcpy(out + total, &records_[head_], first * sizeof(ProphetStamp));
      if (n > first) std::memcpy(out + total + first, &records_[0], (n - first) * sizeof(ProphetStamp));
      head_ = (head_ + n) & (kCapacity - 1);
      count_ -= n;
      total += n;
    }
    return total;
  }

  int64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }

  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    head_ = 0;
    count_ = 0;
    dropped_.store(0, std::memory_order_relaxed);
  }

 private:
  std::mutex mu_;
  std::unique_ptr<ProphetStamp[]> records_;
  int64_t head_ = 0;
  int64_t count_ = 0;
  std::atomic<int64_t> dropped_{0};
};

StampBuffer& Stamps() {
  static StampBuffer* buffer = new StampBuffer;  // never destroyed: no exit-order issues
  return *buffer;
}

// ---------------------------------------------------------------------------
// Gradient queue and parameter staging.

struct PendingAwait {
  int64_t id;
  int64_t step;
  CancellationManager* cm;  // may be null (a context without one)
  CancellationToken token;
  AwaitCallback callback;
};

// An AwaitParam outcome, run outside the runtime lock (a callback calls the
// kernel's done(), which may schedule more work).
struct Completion {
  AwaitCallback callback;
  absl::Status status;
  Tensor value;
  CancellationManager* cm = nullptr;
  CancellationToken token = 0;
};

void RunCompletions(std::vector<Completion>* completions) {
  for (Completion& c : *completions) {
    // Never blocks; if a cancellation is racing with us, its callback finds
    // the request gone and does nothing.
    if (c.cm != nullptr) c.cm->TryDeregisterCallback(c.token);
    c.callback(c.status, c.value);
  }
}

// A version being written: begin .. commit (or cancel).
struct Delivery {
  Tensor buffer;
  int writers = 0;  // prophet_deliver_write calls copying into `buffer` now
};

struct Param {
  DataType dtype;
  TensorShape shape;
  bool has_value = false;
  bool frozen = false;  // serves the staged value at any step
  int64_t version = -1;
  Tensor value;                         // the staged value readers get
  std::map<int64_t, Delivery> writing;  // version -> buffer between begin and commit
  std::vector<PendingAwait> pending;
};

struct QueuedGrad {
  int64_t key;
  int64_t step;
  int64_t ready_ns;
  Tensor grad;
};

char empty_buffer_sentinel;

void* DataPointer(const Tensor& t) {
  if (t.NumElements() == 0) return &empty_buffer_sentinel;
  return const_cast<char*>(t.tensor_data().data());
}

bool SameBuffer(const Tensor& a, const Tensor& b) {
  return a.tensor_data().data() == b.tensor_data().data();
}

// What a registered cancellation callback carries. 24 bytes, so std::function
// keeps it in one heap block written by our (instrumented) code.
struct CancelTicket {
  int64_t key;
  int64_t id;
  int64_t step;
};
static_assert(sizeof(CancelTicket) > 2 * sizeof(void*),
              "kept out of std::function's small buffer, which TensorFlow moves uninstrumented");

class Runtime;
Runtime& TheRuntime();

class Runtime {
 public:
  absl::Status EnqueueGrad(int64_t key, int64_t step, const Tensor& grad, int64_t ready_ns) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_) return AbortedStatus();
      grads_.push_back(QueuedGrad{key, step, ready_ns, grad});
    }
    grad_cv_.notify_one();
    return absl::OkStatus();
  }

  int NextGrad(int64_t timeout_us, ProphetGradInfo* out) {
    if (out == nullptr) return Fail(PROPHET_ERR_INVALID, "prophet_next_grad: out is NULL");
    std::unique_lock<std::mutex> lock(mu_);
    auto ready = [this] { return aborted_ || !grads_.empty(); };
    constexpr int64_t kForever = int64_t{1} << 40;  // ~12 days; avoids deadline overflow
    if (timeout_us < 0 || timeout_us >= kForever) {
      grad_cv_.wait(lock, ready);
    } else {
      grad_cv_.wait_for(lock, std::chrono::microseconds(timeout_us), ready);
    }
    if (aborted_) return Fail(PROPHET_ERR_ABORTED, abort_message_);
    if (grads_.empty()) return 0;
    QueuedGrad g = std::move(grads_.front());
    grads_.pop_front();
    const int64_t handle = next_handle_++;
    out->key = g.key;
    out->step = g.step;
    out->data = DataPointer(g.grad);
    out->nbytes = static_cast<int64_t>(g.grad.tensor_data().size());
    out->handle = handle;
    out->dtype = static_cast<int32_t>(g.grad.dtype());
    out->reserved = 0;
    out->ready_ns = g.ready_ns;
    outstanding_.emplace(handle, std::move(g.grad));
    return 1;
  }

  void ReleaseGrad(int64_t handle) {
    Tensor dropped;  // destroyed after the lock is released
    std::lock_guard<std::mutex> lock(mu_);
    auto it = outstanding_.find(handle);
    if (it == outstanding_.end()) return;
    dropped = std::move(it->second);
    outstanding_.erase(it);
  }

  int64_t OutstandingGrads() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(outstanding_.size());
  }

  int64_t QueuedGrads() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(grads_.size());
  }

  int Declare(int64_t key, int32_t dtype_enum, int32_t ndims, const int64_t* dims) {
    const DataType dtype = static_cast<DataType>(dtype_enum);
    if (key < 0) return Fail(PROPHET_ERR_INVALID, absl::StrCat("key must be >= 0. Received: key=", key));
    if (!IsSupportedDtype(dtype)) {
      return Fail(PROPHET_ERR_INVALID,
                  absl::StrCat("dtype must be one of half, bfloat16, float, double. Received: dtype=",
                               dtype_enum));
    }
    if (ndims < 0 || ndims > TensorShape::MaxDimensions() || (ndims > 0 && dims == nullptr)) {
      return Fail(PROPHET_ERR_INVALID, absl::StrCat("bad rank. Received: ndims=", ndims));
    }
    TensorShape shape;
    for (int32_t i = 0; i < ndims; ++i) {
      if (dims[i] < 0) {
        return Fail(PROPHET_ERR_INVALID,
                    absl::StrCat("dims must be >= 0. Received: dims[", i, "]=", dims[i]));
      }
      if (!shape.AddDimWithStatus(dims[i]).ok()) {
        return Fail(PROPHET_ERR_INVALID, "shape too large");
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto it = params_.find(key);
    if (it != params_.end()) {
      if (it->second.dtype == dtype && it->second.shape == shape) return PROPHET_OK;
      return Fail(PROPHET_ERR_CONFLICT,
                  absl::StrCat("parameter key=", key, " was declared as ",
                               tensorflow::DataTypeString(it->second.dtype), it->second.shape.DebugString(),
                               ". Received: ", tensorflow::DataTypeString(dtype), shape.DebugString()));
    }
    Param& p = params_[key];
    p.dtype = dtype;
    p.shape = shape;
    Log(kDebug, absl::StrCat("declared key=", key, " ", tensorflow::DataTypeString(dtype),
                             shape.DebugString()));
    return PROPHET_OK;
  }

  int DeliverBegin(int64_t key, int64_t version) {
    std::lock_guard<std::mutex> lock(mu_);
    Param* p = nullptr;
    if (int rc = CheckDelivery(key, version, &p); rc != PROPHET_OK) return rc;
    if (p->writing.find(version) == p->writing.end()) {
      p->writing.emplace(version, Delivery{Tensor(p->dtype, p->shape), 0});
    }
    return PROPHET_OK;
  }

  int DeliverWrite(int64_t key, int64_t version, int64_t offset, const void* src, int64_t nbytes) {
    Tensor target;  // shares the buffer: keeps it alive while we copy into it
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = params_.find(key);
      if (it == params_.end()) return Fail(PROPHET_ERR_UNDECLARED, UndeclaredMessage(key));
      if (aborted_) return Fail(PROPHET_ERR_ABORTED, abort_message_);
      auto w = it->second.writing.find(version);
      if (w == it->second.writing.end()) {
        return Fail(PROPHET_ERR_NO_DELIVERY,
                    absl::StrCat("prophet_deliver_write without prophet_deliver_begin. Received: key=",
                                 key, ", version=", version));
      }
      const int64_t size = static_cast<int64_t>(w->second.buffer.tensor_data().size());
      // Written so that no sum can overflow: offset <= size, nbytes <= size - offset.
      if (offset < 0 || nbytes < 0 || offset > size || nbytes > size - offset) {
        return Fail(PROPHET_ERR_BOUNDS,
                    absl::StrCat("write outside parameter key=", key, " (", size,
                                 " bytes). Received: offset=", offset, ", nbytes=", nbytes));
      }
      if (nbytes > 0 && src == nullptr) {
        return Fail(PROPHET_ERR_INVALID, "prophet_deliver_write: src is NULL");
      }
      if (nbytes == 0) return PROPHET_OK;
      target = w->second.buffer;
      ++w->second.writers;
    }
    std::memcpy(static_cast<char*>(DataPointer(target)) + offset, src, static_cast<size_t>(nbytes));
    std::lock_guard<std::mutex> lock(mu_);
    // The delivery may be gone (cancel, reset, failed commit): then only our
    // reference kept the buffer alive, and it goes with `target`.
    auto it = params_.find(key);
    if (it != params_.end()) {
      auto w = it->second.writing.find(version);
      if (w != it->second.writing.end() && SameBuffer(w->second.buffer, target)) {
        --w->second.writers;
      }
    }
    return PROPHET_OK;
  }

  int DeliverCommit(int64_t key, int64_t version) {
    std::vector<Completion> completions;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Param* p = nullptr;
      if (int rc = CheckDelivery(key, version, &p); rc != PROPHET_OK) {
        if (p != nullptr) p->writing.erase(version);
        return rc;
      }
      auto w = p->writing.find(version);
      if (w == p->writing.end()) {
        return Fail(PROPHET_ERR_NO_DELIVERY,
                    absl::StrCat("prophet_deliver_commit without prophet_deliver_begin. Received: key=",
                                 key, ", version=", version));
      }
      if (w->second.writers > 0) {
        // Readers would see a value still being written.
        return Fail(PROPHET_ERR_BUSY,
                    absl::StrCat("prophet_deliver_commit while ", w->second.writers,
                                 " write(s) into it are in progress. Received: key=", key,
                                 ", version=", version));
      }
      p->value = std::move(w->second.buffer);
      p->writing.erase(w);
      p->version = version;
      p->has_value = true;
      const bool frozen = p->frozen;
      auto keep = std::partition(
          p->pending.begin(), p->pending.end(),
          [version, frozen](const PendingAwait& a) { return !frozen && a.step > version; });
      for (auto a = keep; a != p->pending.end(); ++a) {
        completions.push_back(Completion{std::move(a->callback), absl::OkStatus(), p->value, a->cm, a->token});
      }
      p->pending.erase(keep, p->pending.end());
    }
    // Stamped before the waiters run, so DELIVER precedes their AWAIT_END.
    RecordStamp(key, version, PROPHET_STAMP_DELIVER);
    RunCompletions(&completions);
    return PROPHET_OK;
  }

  int DeliverCancel(int64_t key, int64_t version) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = params_.find(key);
    if (it == params_.end()) return Fail(PROPHET_ERR_UNDECLARED, UndeclaredMessage(key));
    if (it->second.writing.erase(version) == 0) {
      return Fail(PROPHET_ERR_NO_DELIVERY,
                  absl::StrCat("no delivery in progress. Received: key=", key, ", version=", version));
    }
    return PROPHET_OK;
  }

  int64_t ParamNbytes(int64_t key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = params_.find(key);
    if (it == params_.end()) return Fail(PROPHET_ERR_UNDECLARED, UndeclaredMessage(key));
    return tensorflow::DataTypeSize(it->second.dtype) * it->second.shape.num_elements();
  }

  int Freeze(int64_t key) {
    std::vector<Completion> completions;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = params_.find(key);
      if (it == params_.end()) return Fail(PROPHET_ERR_UNDECLARED, UndeclaredMessage(key));
      Param& p = it->second;
      p.frozen = true;
      if (p.has_value) {
        for (PendingAwait& a : p.pending) {
          completions.push_back(Completion{std::move(a.callback), absl::OkStatus(), p.value, a.cm, a.token});
        }
        p.pending.clear();
      }
    }
    RunCompletions(&completions);
    return PROPHET_OK;
  }

  int32_t ParamDtype(int64_t key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = params_.find(key);
    if (it == params_.end()) return Fail(PROPHET_ERR_UNDECLARED, UndeclaredMessage(key));
    return static_cast<int32_t>(it->second.dtype);
  }

  int64_t ParamVersion(int64_t key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = params_.find(key);
    if (it == params_.end()) return Fail(PROPHET_ERR_UNDECLARED, UndeclaredMessage(key));
    return it->second.has_value ? it->second.version : -1;
  }

  int64_t PendingAwaits() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t n = 0;
    for (const auto& kv : params_) n += static_cast<int64_t>(kv.second.pending.size());
    return n;
  }

  void Await(int64_t key, int64_t step, DataType dtype, const PartialTensorShape& shape,
             CancellationManager* cm, AwaitCallback callback) {
    absl::Status status;
    Tensor value;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = params_.find(key);
      if (aborted_) {
        status = AbortedStatus();
      } else if (it == params_.end()) {
        status = absl::FailedPreconditionError(absl::StrCat(
            "AwaitParam: parameter key=", key,
            " was not declared (prophet_declare_param must run before the step). Received: key=", key));
      } else if (it->second.dtype != dtype || !shape.IsCompatibleWith(it->second.shape)) {
        status = absl::InvalidArgumentError(absl::StrCat(
            "AwaitParam(key=", key, ") has dtype=", tensorflow::DataTypeString(dtype),
            ", shape=", shape.DebugString(), " but the parameter was declared with dtype=",
            tensorflow::DataTypeString(it->second.dtype), ", shape=", it->second.shape.DebugString()));
      } else if (it->second.has_value && (it->second.frozen || step <= it->second.version)) {
        value = it->second.value;
      } else {
        const int64_t id = next_await_id_++;
        CancellationToken token = 0;
        if (cm != nullptr) {
          token = cm->get_cancellation_token();
          // Registered under mu_ (the pattern cancellation.h recommends): the
          // callback takes mu_, so it cannot run before the request is listed.
          // It reaches the runtime through TheRuntime() and reads its ticket
          // only after taking mu_: the manager orders registration before the
          // callback with its own mutex, which ThreadSanitizer cannot see in
          // the uninstrumented TensorFlow library; mu_ makes that order visible.
          const CancelTicket ticket{key, id, step};
          if (!cm->RegisterCallback(token, [ticket] { TheRuntime().Cancel(ticket); })) {
            status = absl::CancelledError(
                absl::StrCat("AwaitParam(key=", key, ", step=", step, ") was cancelled"));
          }
        }
        if (status.ok()) {
          it->second.pending.push_back(PendingAwait{id, step, cm, token, std::move(callback)});
          return;
        }
      }
    }
    callback(status, value);
  }

  void Abort(const char* message) {
    std::vector<Completion> completions;
    std::string logged;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!aborted_) {
        aborted_ = true;
        abort_message_ = message != nullptr ? message : "aborted";
      }
      const absl::Status status = AbortedStatus();
      TakeAllPending(status, &completions);
      grads_.clear();
      logged = abort_message_;
    }
    grad_cv_.notify_all();
    Log(kWarning, absl::StrCat("runtime aborted: ", logged, " (", completions.size(),
                               " pending AwaitParam failed)"));
    RunCompletions(&completions);
  }

  void Reset() {
    std::vector<Completion> completions;
    std::unordered_map<int64_t, Tensor> outstanding;
    std::deque<QueuedGrad> grads;
    std::unordered_map<int64_t, Param> params;
    {
      std::lock_guard<std::mutex> lock(mu_);
      TakeAllPending(absl::CancelledError("prophet_tf runtime was reset while AwaitParam was waiting"),
                     &completions);
      outstanding.swap(outstanding_);
      grads.swap(grads_);
      params.swap(params_);
      aborted_ = false;
      abort_message_.clear();
    }
    grad_cv_.notify_all();
    Stamps().Clear();
    Log(kInfo, "runtime reset");
    RunCompletions(&completions);
  }

 private:
  absl::Status AbortedStatus() const {
    return absl::AbortedError(absl::StrCat("prophet_tf engine aborted: ", abort_message_));
  }

  static std::string UndeclaredMessage(int64_t key) {
    return absl::StrCat("parameter was not declared. Received: key=", key);
  }

  // Requires mu_. Validates a deliver_begin/commit; sets *p when declared.
  int CheckDelivery(int64_t key, int64_t version, Param** p) {
    auto it = params_.find(key);
    if (it == params_.end()) return Fail(PROPHET_ERR_UNDECLARED, UndeclaredMessage(key));
    *p = &it->second;
    if (aborted_) return Fail(PROPHET_ERR_ABORTED, abort_message_);
    if (version < 0) {
      return Fail(PROPHET_ERR_INVALID, absl::StrCat("version must be >= 0. Received: version=", version));
    }
    // Equal versions are allowed: re-staging a version replaces its value
    // (e.g. set_weights before training); readers keep what they got.
    if ((*p)->has_value && version < (*p)->version) {
      return Fail(PROPHET_ERR_VERSION_ORDER,
                  absl::StrCat("versions must not go back: key=", key, " is staged at version ",
                               (*p)->version, ". Received: version=", version));
    }
    return PROPHET_OK;
  }

  // Requires mu_.
  void TakeAllPending(const absl::Status& status, std::vector<Completion>* out) {
    for (auto& kv : params_) {
      for (PendingAwait& a : kv.second.pending) {
        out->push_back(Completion{std::move(a.callback), status, Tensor(), a.cm, a.token});
      }
      kv.second.pending.clear();
    }
  }

  // Cancellation callback of one pending AwaitParam.
  // Runs inside the manager's StartCancel. `ticket` lives in the manager's
  // callback storage: read it only under mu_ (see Await).
  void Cancel(const CancelTicket& ticket) {
    AwaitCallback callback;
    int64_t key = 0;
    int64_t step = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      key = ticket.key;
      const int64_t id = ticket.id;
      auto it = params_.find(key);
      if (it == params_.end()) return;
      auto& pending = it->second.pending;
      auto a = std::find_if(pending.begin(), pending.end(),
                            [id](const PendingAwait& x) { return x.id == id; });
      if (a == pending.end()) return;  // already completed
      callback = std::move(a->callback);
      step = a->step;
      pending.erase(a);
    }
    // No deregistration: we are running inside the manager's StartCancel.
    callback(absl::CancelledError(absl::StrCat("AwaitParam(key=", key, ", step=", step,
                                               ") was cancelled")),
             Tensor());
  }

  std::mutex mu_;
  std::condition_variable grad_cv_;
  bool aborted_ = false;
  std::string abort_message_;
  std::deque<QueuedGrad> grads_;
  std::unordered_map<int64_t, Tensor> outstanding_;
  int64_t next_handle_ = 1;
  std::unordered_map<int64_t, Param> params_;
  int64_t next_await_id_ = 1;
};

Runtime& TheRuntime() {
  static Runtime* runtime = new Runtime;  // never destroyed
  return *runtime;
}

}  // namespace

int64_t NowNs() {
  // CLOCK_MONOTONIC is what Python's time.monotonic_ns() reads on Linux.
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

int64_t RecordStamp(int64_t key, int64_t step, int32_t kind) {
  return Stamps().Record(key, step, kind);
}

absl::Status EnqueueGrad(int64_t key, int64_t step, const Tensor& grad, int64_t ready_ns) {
  return TheRuntime().EnqueueGrad(key, step, grad, ready_ns);
}

void AwaitParam(int64_t key, int64_t step, DataType dtype, const PartialTensorShape& shape,
                CancellationManager* cm, AwaitCallback callback) {
  TheRuntime().Await(key, step, dtype, shape, cm, std::move(callback));
}

}  // namespace prophet_tf

// ---------------------------------------------------------------------------
// C API (see runtime.h). Never throws, never crashes on bad input.

extern "C" {

int64_t prophet_now_ns(void) { return prophet_tf::NowNs(); }

void prophet_stamp(int64_t key, int64_t step, int32_t kind) { prophet_tf::RecordStamp(key, step, kind); }

int64_t prophet_drain_stamps(ProphetStamp* out, int64_t max) {
  if (out == nullptr || max <= 0) return 0;
  return prophet_tf::Stamps().Drain(out, max);
}

int64_t prophet_stamps_dropped(void) { return prophet_tf::Stamps().dropped(); }

int64_t prophet_stamp_benchmark(int64_t n, int32_t kind) {
  const int64_t start = prophet_tf::NowNs();
  for (int64_t i = 0; i < n; ++i) prophet_tf::RecordStamp(i, 0, kind);
  return prophet_tf::NowNs() - start;
}

int64_t prophet_stamp_capacity(void) { return prophet_tf::StampBuffer::kCapacity; }

const char* prophet_stamp_kind_name(int32_t kind) {
  switch (kind) {
    case PROPHET_STAMP_READY: return "READY";
    case PROPHET_STAMP_AWAIT_BEGIN: return "AWAIT_BEGIN";
    case PROPHET_STAMP_AWAIT_END: return "AWAIT_END";
    case PROPHET_STAMP_DELIVER: return "DELIVER";
  }
  return nullptr;
}

int prophet_next_grad(int64_t timeout_us, ProphetGradInfo* out) {
  return prophet_tf::TheRuntime().NextGrad(timeout_us, out);
}

void prophet_release_grad(int64_t handle) { prophet_tf::TheRuntime().ReleaseGrad(handle); }

int64_t prophet_outstanding_grads(void) { return prophet_tf::TheRuntime().OutstandingGrads(); }

int64_t prophet_queued_grads(void) { return prophet_tf::TheRuntime().QueuedGrads(); }

int prophet_declare_param(int64_t key, int32_t dtype, int32_t ndims, const int64_t* dims) {
  return prophet_tf::TheRuntime().Declare(key, dtype, ndims, dims);
}

int prophet_deliver_begin(int64_t key, int64_t version) {
  return prophet_tf::TheRuntime().DeliverBegin(key, version);
}

int prophet_deliver_write(int64_t key, int64_t version, int64_t offset, const void* src,
                          int64_t nbytes) {
  return prophet_tf::TheRuntime().DeliverWrite(key, version, offset, src, nbytes);
}

int prophet_deliver_commit(int64_t key, int64_t version) {
  return prophet_tf::TheRuntime().DeliverCommit(key, version);
}

int prophet_deliver_cancel(int64_t key, int64_t version) {
  return prophet_tf::TheRuntime().DeliverCancel(key, version);
}

int64_t prophet_param_nbytes(int64_t key) { return prophet_tf::TheRuntime().ParamNbytes(key); }

int64_t prophet_param_version(int64_t key) { return prophet_tf::TheRuntime().ParamVersion(key); }

int32_t prophet_param_dtype(int64_t key) { return prophet_tf::TheRuntime().ParamDtype(key); }

int prophet_freeze_param(int64_t key) { return prophet_tf::TheRuntime().Freeze(key); }

int64_t prophet_pending_awaits(void) { return prophet_tf::TheRuntime().PendingAwaits(); }

void prophet_abort(const char* message) { prophet_tf::TheRuntime().Abort(message); }

void prophet_reset(void) { prophet_tf::TheRuntime().Reset(); }

const char* prophet_last_error(void) { return prophet_tf::last_error.c_str(); }

int prophet_last_error_code(void) { return prophet_tf::last_error_code; }

}  // extern "C"
