// The transport bench's bare traffic through gRPC's C++ library: what gRPC
// itself costs per byte without Python, the floor of a native data path.
// Built and run by benchmarks/bench_grpc_floor.py (Debian's libgrpc++-dev).
//
//   bare_grpc server PORT_FILE
//       serves /bare.Bare/Push (answers an empty message) and /bare.Bare/Pull
//       (request "<count> <size>": streams count messages of size zero bytes),
//       the wire protocol of bench_transport.py's grpcio bare server, so a
//       client of either kind talks to a server of either kind.
//   bare_grpc client INFLIGHT PORT=SIZE,SIZE,... [PORT=SIZE,...]
//       a step pushes every SIZE to its PORT (INFLIGHT unary calls at a time)
//       while one Pull stream per server asks for as many messages of its
//       largest size. One warm-up step, then "ready" on stdout; then a step
//       for each line read on stdin, each answered "<wall s> <CPU s>" (this
//       process's CPU in that step), so that a caller can take turns with
//       other clients; it ends at the end of its input.
// Messages are prebuilt slices sent by reference and received ones dropped:
// no copy by this program, so what is measured is gRPC's own work.
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <sys/resource.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

namespace {

constexpr long kMaxMessage = 1L << 30;  // as prophet_tf.ps.protocol's limit, at most

grpc::ByteBuffer Zeros(size_t size) {
  std::string bytes(size, '\0');
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

[[noreturn]] void Fail(const std::string& message) {
  std::fprintf(stderr, "bare_grpc: %s\n", message.c_str());
  std::exit(2);
}

long ParseCount(const std::string& text, const std::string& what) {
  char* end = nullptr;
  long value = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || value < 0 || value > kMaxMessage) {
    Fail(what + " must be an integer in [0, 2**30]. Received: '" + text + "'");
  }
  return value;
}

// --- server -------------------------------------------------------------------

class Reactor : public grpc::ServerGenericBidiReactor {
 public:
  Reactor(grpc::GenericCallbackServerContext* context, std::map<long, grpc::ByteBuffer>* payloads,
          std::mutex* payloads_mutex)
      : pull_(context->method() == "/bare.Bare/Pull"),
        payloads_(payloads),
        payloads_mutex_(payloads_mutex),
        empty_(Zeros(0)) {  // a default ByteBuffer is no message at all
    if (!pull_ && context->method() != "/bare.Bare/Push") {
      Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, context->method()));
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request"));
      return;
    }
    if (!pull_) {
      StartWriteAndFinish(&empty_, grpc::WriteOptions(), grpc::Status::OK);
      return;
    }
    std::vector<grpc::Slice> slices;
    std::string text;
    if (request_.Dump(&slices).ok()) {
      for (const auto& s : slices) text.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    std::istringstream fields(text);
    long count = -1, size = -1;
    if (!(fields >> count >> size) || count < 0 || size < 0 || size > kMaxMessage) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "Pull takes \"<count> <size>\". Received: " + text));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(*payloads_mutex_);
      auto it = payloads_->find(size);
      if (it == payloads_->end()) it = payloads_->emplace(size, Zeros(size)).first;
      payload_ = it->second;  // shares the slice
    }
    left_ = count;
    WriteNext();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed"));
      return;
    }
    if (pull_) WriteNext();
  }

  void OnDone() override { delete this; }

 private:
  void WriteNext() {
    if (left_ == 0) {
      Finish(grpc::Status::OK);
      return;
    }
    --left_;
    StartWrite(&payload_);
  }

  const bool pull_;
  std::map<long, grpc::ByteBuffer>* payloads_;
  std::mutex* payloads_mutex_;
  grpc::ByteBuffer empty_, request_, payload_;
  long left_ = 0;
};

class BareService : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override {
    return new Reactor(context, &payloads_, &mutex_);
  }

 private:
  std::map<long, grpc::ByteBuffer> payloads_;
  std::mutex mutex_;
};

int Serve(const std::string& port_file) {
  BareService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) Fail("the server did not start");
  {
    std::string tmp = port_file + ".tmp";
    std::ofstream(tmp) << port;
    if (std::rename(tmp.c_str(), port_file.c_str()) != 0) Fail("cannot write " + port_file);
  }
  server->Wait();  // until SIGTERM ends the process
  return 0;
}

// --- client -------------------------------------------------------------------

struct Target {
  std::unique_ptr<grpc::GenericStub> stub;
  std::vector<grpc::ByteBuffer> pushes;
  std::string pull_request;
};

// Counts the RPCs of one step still running; the step ends at zero.
class Step {
 public:
  explicit Step(int calls) : left_(calls) {}
  void Done(const grpc::Status& status) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!status.ok()) Fail("an RPC failed: " + status.error_message());
    if (--left_ == 0) done_.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return left_ == 0; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_;
  int left_;
};

class PullStream : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  PullStream(Target* target, Step* step) : step_(step) {
    grpc::Slice slice(target->pull_request);
    request_ = grpc::ByteBuffer(&slice, 1);
    target->stub->PrepareBidiStreamingCall(&context_, "/bare.Bare/Pull", grpc::StubOptions(),
                                           this);
    StartWriteLast(&request_, grpc::WriteOptions());
    StartRead(&message_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream's end: OnDone follows
    message_.Clear();
    StartRead(&message_);
  }
  void OnDone(const grpc::Status& status) override { step_->Done(status); }

 private:
  grpc::ClientContext context_;
  grpc::ByteBuffer request_, message_;
  Step* step_;
};

// The step's pushes, INFLIGHT at a time, each started when one ends.
class Pushes {
 public:
  Pushes(std::vector<Target>* targets, Step* step) : step_(step) {
    for (auto& target : *targets) {
      for (auto& payload : target.pushes) calls_.push_back({target.stub.get(), &payload});
    }
    responses_.resize(calls_.size());
    contexts_.resize(calls_.size());
  }
  void Start(size_t inflight) {
    for (size_t i = 0; i < inflight; ++i) Next();
  }

 private:
  void Next() {
    size_t i;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (next_ == calls_.size()) return;
      i = next_++;
    }
    contexts_[i] = std::make_unique<grpc::ClientContext>();
    calls_[i].first->UnaryCall(contexts_[i].get(), "/bare.Bare/Push", grpc::StubOptions(),
                               calls_[i].second, &responses_[i], [this](grpc::Status status) {
                                 Next();  // first: the step may end at Done
                                 step_->Done(status);
                               });
  }

  Step* step_;
  std::vector<std::pair<grpc::GenericStub*, const grpc::ByteBuffer*>> calls_;
  std::vector<grpc::ByteBuffer> responses_;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts_;
  std::mutex mutex_;
  size_t next_ = 0;
};

double CpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_utime.tv_sec + usage.ru_stime.tv_sec +
         (usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
}

double RunStep(std::vector<Target>* targets, size_t inflight) {
  size_t pushes = 0;
  for (const auto& target : *targets) pushes += target.pushes.size();
  Step step(static_cast<int>(pushes + targets->size()));
  auto start = std::chrono::steady_clock::now();
  std::vector<std::unique_ptr<PullStream>> pulls;
  for (auto& target : *targets) pulls.push_back(std::make_unique<PullStream>(&target, &step));
  Pushes calls(targets, &step);
  calls.Start(inflight);
  step.Wait();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int Client(int argc, char** argv) {
  if (argc < 4) Fail("client takes INFLIGHT PORT=SIZE,SIZE,... [PORT=...]");
  long inflight = ParseCount(argv[2], "INFLIGHT");
  if (inflight < 1) Fail("INFLIGHT must be at least 1. Received: 0");
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  std::vector<Target> targets;
  for (int i = 3; i < argc; ++i) {
    std::string spec = argv[i];
    size_t eq = spec.find('=');
    if (eq == std::string::npos) Fail("a server is PORT=SIZE,SIZE,... Received: '" + spec + "'");
    Target target;
    long port = ParseCount(spec.substr(0, eq), "PORT");
    target.stub = std::make_unique<grpc::GenericStub>(grpc::CreateCustomChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), args));
    std::stringstream sizes(spec.substr(eq + 1));
    std::string size;
    long largest = 0;
    while (std::getline(sizes, size, ',')) {
      long n = ParseCount(size, "SIZE");
      largest = std::max(largest, n);
      target.pushes.push_back(Zeros(n));
    }
    if (target.pushes.empty()) Fail("a server needs at least one SIZE. Received: '" + spec + "'");
    target.pull_request = std::to_string(target.pushes.size()) + " " + std::to_string(largest);
    targets.push_back(std::move(target));
  }
  RunStep(&targets, inflight);  // warm-up: connections, buffers
  std::cout << "ready" << std::endl;
  std::string line;
  while (std::getline(std::cin, line)) {
    double cpu = CpuSeconds();
    double wall = RunStep(&targets, inflight);
    std::cout << wall << " " << CpuSeconds() - cpu << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "server" && argc == 3) return Serve(argv[2]);
  if (mode == "client") return Client(argc, argv);
  Fail("usage: bare_grpc server PORT_FILE | bare_grpc client INFLIGHT PORT=SIZE,... ...");
}
