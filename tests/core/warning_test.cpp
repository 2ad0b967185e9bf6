// detail::warn goes through c10's warning handler (TORCH_WARN's channel),
// warnOnce emits once per key, and neither throws when the handler does.
#include "shardema/core/warning.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

namespace shardema {
namespace {

// Records what reaches c10's handler while it is installed.
class RecordingHandler : public c10::WarningHandler {
 public:
  RecordingHandler() : previous_(c10::WarningUtils::get_warning_handler()) {
    c10::WarningUtils::set_warning_handler(this);
  }
  ~RecordingHandler() override { c10::WarningUtils::set_warning_handler(previous_); }
  RecordingHandler(const RecordingHandler&) = delete;
  RecordingHandler& operator=(const RecordingHandler&) = delete;

  void process(const c10::Warning& warning) override {
    if (throwing) throw std::runtime_error("warnings are errors");
    messages.push_back(warning.msg());
  }

  std::vector<std::string> messages;
  bool throwing = false;

 private:
  c10::WarningHandler* previous_;
};

TEST(WarningTest, WarnReachesC10sHandler) {
  RecordingHandler handler;
  detail::warn("PostHocCallback: first");
  detail::warn("PostHocCallback: second");
  ASSERT_EQ(handler.messages.size(), 2u);
  EXPECT_EQ(handler.messages[0], "PostHocCallback: first");
  EXPECT_EQ(handler.messages[1], "PostHocCallback: second");
}

// c10's handler is per thread: the racing threads print through the
// default one, and the key is spent for this thread too.
TEST(WarningTest, WarnOnceEmitsOncePerKeyAcrossThreads) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([] { detail::warnOnce("WarningTest.a", "WarningTest: a once"); });
  }
  for (std::thread& thread : threads) thread.join();
  RecordingHandler handler;
  detail::warnOnce("WarningTest.a", "a again");
  detail::warnOnce("WarningTest.b", "b once");
  detail::warnOnce("WarningTest.b", "b again");
  const std::vector<std::string> expected = {"b once"};
  EXPECT_EQ(handler.messages, expected);
}

TEST(WarningTest, AThrowingHandlerDoesNotReachTheCaller) {
  RecordingHandler handler;
  handler.throwing = true;
  EXPECT_NO_THROW(detail::warn("dropped"));
  EXPECT_NO_THROW(detail::warnOnce("WarningTest.c", "dropped too"));
}

}  // namespace
}  // namespace shardema
