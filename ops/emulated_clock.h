// The emulated device's clock: when data last became ready to it.
//
// On a GPU the host queues kernels ahead of the device, so the device starts
// a kernel as soon as its inputs are ready there; the host's latency in
// launching it stays hidden. EmulatedDelay, which stands in for a kernel,
// starts from the host's view instead: its predecessor's completion must wake
// an executor thread first, which on a virtual machine costs about 0.1 ms, and
// more when the cores are busy. Over a model's hundred layers that adds up.
//
// So the moments at which data becomes ready to the emulated device are noted
// here (a delay's deadline, a parameter's arrival), and a delay that asks for
// it starts from the latest such moment when that is at most kLaunchWindow
// ago (emulated_delay_op.cc). Waits the clock does not know of must not fall
// inside the window: the emulated model lets only the delays within a step
// ask (prophet_tf/bench/emulated.py), where every wait is a parameter's.

#ifndef PROPHET_TF_OPS_EMULATED_CLOCK_H_
#define PROPHET_TF_OPS_EMULATED_CLOCK_H_

#include <chrono>

namespace prophet_tf {

using EmulatedClock = std::chrono::steady_clock;

// Longer than a host's time slice under load (a few ms), so that neither
// executor wake-ups nor a preempted host thread delay the emulated device;
// short against any step.
constexpr EmulatedClock::duration kLaunchWindow = std::chrono::milliseconds(10);

// Data became ready to the emulated device at `t` (thread-safe; keeps the
// latest). Does nothing until a delay has asked for the clock, so that
// training without emulated compute pays only one atomic load.
void NoteDataReady(EmulatedClock::time_point t);

// Whether any delay has asked for the clock (DeviceStart) in this process.
bool EmulatedClockInUse();

// When a delay started by the host at `now` starts on the emulated device:
// the last noted moment if it is at most kLaunchWindow before `now`, else `now`.
EmulatedClock::time_point DeviceStart(EmulatedClock::time_point now);

}  // namespace prophet_tf

#endif  // PROPHET_TF_OPS_EMULATED_CLOCK_H_
