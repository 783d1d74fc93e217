// EmulatedDelay: forwards its input after `seconds`, without using a CPU
// meanwhile (emulates a device that computes while the host stays free).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <sys/prctl.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "emulated_clock.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace prophet_tf {

using tensorflow::AsyncOpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;

namespace {

// Bounds the deadline arithmetic (no overflow of the clock's nanoseconds).
constexpr double kMaxSeconds = 86400.0;

// One thread for every pending delay of the process: a min-heap of deadlines
// and a condition variable, so a delay holds no thread while it waits.
class DelayTimer {
 public:
  using Clock = EmulatedClock;

  // Created on first use and never destroyed: the thread is detached and may
  // be waiting when the process exits, so its mutex, condition variable and
  // heap must outlive every static destructor.
  static DelayTimer& Get() {
    static DelayTimer* timer = [] {
      auto* t = new DelayTimer;
      std::thread([t] { t->Run(); }).detach();
      // Registered after the statics TensorFlow built at load time, so it
      // runs before their destructors: from then on no callback reaches TF.
      std::atexit([] { Get().Stop(); });
      return t;
    }();
    return *timer;
  }

  void Schedule(Clock::time_point deadline, std::function<void()> done) {
    std::lock_guard<std::mutex> lock(mu_);
    heap_.push_back(Entry{deadline, next_seq_++, std::move(done)});
    std::push_heap(heap_.begin(), heap_.end(), Later());
    // Only a new earliest deadline changes what the thread waits for.
    if (heap_.front().seq == next_seq_ - 1) cv_.notify_all();
  }

 private:
  struct Entry {
    Clock::time_point deadline;
    uint64_t seq;  // equal deadlines complete in submission order
    std::function<void()> done;
  };
  struct Later {
    bool operator()(const Entry& a, const Entry& b) const {
      return a.deadline != b.deadline ? a.deadline > b.deadline : a.seq > b.seq;
    }
  };

  void Run() {
    // Linux lets a timed wait wake up to the thread's timer slack (50 us by
    // default) late; over a model's hundred layers that would add up.
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
    std::vector<std::function<void()>> due;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (stopping_) {
        // Exiting: pending callbacks are dropped (leaked, not destroyed),
        // since their captured executor state may already be torn down.
        cv_.wait(lock);
        continue;
      }
      if (heap_.empty()) {
        cv_.wait(lock);
        continue;
      }
      const Clock::time_point now = Clock::now();
      if (heap_.front().deadline > now) {
        cv_.wait_until(lock, heap_.front().deadline);
        continue;
      }
      while (!heap_.empty() && heap_.front().deadline <= now) {
        NoteDataReady(heap_.front().deadline);  // the output is ready from then on
        std::pop_heap(heap_.begin(), heap_.end(), Later());
        due.push_back(std::move(heap_.back().done));
        heap_.pop_back();
      }
      in_callbacks_ = true;
      lock.unlock();
      // Outside the lock: a callback may schedule the next delay.
      for (auto& done : due) done();
      due.clear();
      lock.lock();
      in_callbacks_ = false;
      cv_.notify_all();
    }
  }

  // At exit: stop calling back, and give a running batch of callbacks a
  // bounded time to finish (one stuck callback must not hang the exit).
  void Stop() {
    std::unique_lock<std::mutex> lock(mu_);
    stopping_ = true;
    cv_.wait_for(lock, std::chrono::seconds(1), [this] { return !in_callbacks_; });
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Entry> heap_;
  uint64_t next_seq_ = 0;
  bool in_callbacks_ = false;
  bool stopping_ = false;
};

}  // namespace

class EmulatedDelayOp : public AsyncOpKernel {
 public:
  explicit EmulatedDelayOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("hide_launch_gap", &hide_launch_gap_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const auto now = DelayTimer::Clock::now();
    const auto start = hide_launch_gap_ ? DeviceStart(now) : now;
    const Tensor& seconds_t = ctx->input(1);
    OP_REQUIRES_ASYNC(ctx, tensorflow::TensorShapeUtils::IsScalar(seconds_t.shape()),
                      absl::InvalidArgumentError(absl::StrCat(
                          "EmulatedDelay: seconds must be a scalar. Received: seconds.shape=",
                          seconds_t.shape().DebugString())),
                      done);
    const double seconds = seconds_t.scalar<float>()();
    OP_REQUIRES_ASYNC(ctx, std::isfinite(seconds) && seconds >= 0 && seconds <= kMaxSeconds,
                      absl::InvalidArgumentError(absl::StrCat(
                          "EmulatedDelay: seconds must be finite, >= 0 and <= ", kMaxSeconds,
                          ". Received: seconds=", seconds)),
                      done);
    ctx->set_output(0, ctx->input(0));  // forwards the buffer: no copy
    if (seconds == 0) {
      done();
      return;
    }
    // From here `ctx` is not touched again: the timer calls only `done`.
    DelayTimer::Get().Schedule(
        start + std::chrono::duration_cast<DelayTimer::Clock::duration>(
                    std::chrono::duration<double>(seconds)),
        std::move(done));
  }

  // Starting the op only pushes onto the timer's heap: run it inline.
  bool IsExpensive() override { return false; }

 private:
  bool hide_launch_gap_ = false;  // start from the emulated device's clock (emulated_clock.h)
};

// No TypeConstraint: the kernel is type-agnostic and serves every T of the op.
REGISTER_KERNEL_BUILDER(Name("EmulatedDelay").Device(tensorflow::DEVICE_CPU), EmulatedDelayOp);

}  // namespace prophet_tf
