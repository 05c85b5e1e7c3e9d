// CPU self-test of the ipc stand-in: a message arrives whole, several senders reach one
// receiver, a sender to a channel nobody receives on gives up, and Remove() wakes a Receive().
#include "ipc/ipc.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <unistd.h>

#define CHECK(c) do { if (!(c)) { std::fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #c); return 1; } } while (0)

int main() {
    const ipc::ChannelKey key = 0x7e570000ull + static_cast<ipc::ChannelKey>(getpid());
    ipc::Node rx(key, ipc::NodeType::kReceiver);
    ipc::Node a(key, ipc::NodeType::kSender), b(key, ipc::NodeType::kSender);
    char big[4000];
    for (std::size_t i = 0; i < sizeof(big); ++i) big[i] = static_cast<char>(i * 7);
    CHECK(a.Send(big, sizeof(big)));
    CHECK(b.Send("xy", 2));
    auto m1 = rx.Receive();
    CHECK(m1 && m1->Size() == sizeof(big) && std::memcmp(m1->Data(), big, sizeof(big)) == 0);
    auto m2 = rx.Receive();
    CHECK(m2 && m2->Size() == 2 && std::memcmp(m2->Data(), "xy", 2) == 0);

    ipc::Node nobody(key + 1, ipc::NodeType::kSender);
    auto t0 = std::chrono::steady_clock::now();
    CHECK(!nobody.Send("z", 1));
    CHECK(std::chrono::steady_clock::now() - t0 > std::chrono::seconds(1));

    std::thread waker([&] { std::this_thread::sleep_for(std::chrono::milliseconds(100)); rx.Remove(); });
    CHECK(rx.Receive() == nullptr);
    waker.join();
    std::puts("ipc stand-in: ok");
    return 0;
}
