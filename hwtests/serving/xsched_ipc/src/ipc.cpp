// Unix datagram sockets named "\0xsched-ipc-<key>": a receiver binds the name, a sender sends
// each message as one datagram to it.
#include "ipc/ipc.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

namespace ipc {
namespace {

constexpr std::size_t kMaxMessage = 1 << 16;
constexpr int kSendTries = 500;  // 10 ms apart: a receiver starting up has 5 s

socklen_t Address(ChannelKey key, sockaddr_un *addr) {
    std::memset(addr, 0, sizeof(*addr));
    addr->sun_family = AF_UNIX;
    int n = std::snprintf(addr->sun_path + 1, sizeof(addr->sun_path) - 1, "xsched-ipc-%llu",
                          static_cast<unsigned long long>(key));
    return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

}  // namespace

Node::Node(ChannelKey key, NodeType type) : key_(key), type_(type) {
    fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0 || type_ != NodeType::kReceiver) return;
    sockaddr_un addr;
    socklen_t len = Address(key_, &addr);
    if (bind(fd_, reinterpret_cast<sockaddr *>(&addr), len) != 0) {
        std::fprintf(stderr, "ipc: bind xsched-ipc-%llu: %s\n", static_cast<unsigned long long>(key_),
                     std::strerror(errno));
        close(fd_);
        fd_ = -1;
    }
}

Node::~Node() { Remove(); }

bool Node::Send(const void *data, std::size_t size) {
    if (fd_ < 0 || removed_.load()) return false;
    sockaddr_un addr;
    socklen_t len = Address(key_, &addr);
    for (int i = 0; i < kSendTries; ++i) {
        ssize_t n = sendto(fd_, data, size, 0, reinterpret_cast<sockaddr *>(&addr), len);
        if (n == static_cast<ssize_t>(size)) return true;
        if (n < 0 && errno != ECONNREFUSED && errno != ENOENT && errno != EAGAIN && errno != ENOBUFS &&
            errno != EINTR)
            return false;
        usleep(10000);
    }
    return false;
}

std::shared_ptr<const Message> Node::Receive() {
    if (fd_ < 0 || type_ != NodeType::kReceiver) return nullptr;
    std::vector<char> buf(kMaxMessage);
    while (!removed_.load()) {
        ssize_t n = recv(fd_, buf.data(), buf.size(), 0);
        if (n > 0) {
            buf.resize(static_cast<std::size_t>(n));
            return std::make_shared<const Message>(std::move(buf));
        }
        if (n < 0 && errno == EINTR) continue;
        return nullptr;  // 0: shut down by Remove()
    }
    return nullptr;
}

void Node::Remove() {
    if (removed_.exchange(true)) return;
    if (fd_ >= 0) {
        // Wakes a Receive() blocked in recv (it returns 0), then lets the name go.
        shutdown(fd_, SHUT_RDWR);
        close(fd_);
        fd_ = -1;
    }
}

}  // namespace ipc
