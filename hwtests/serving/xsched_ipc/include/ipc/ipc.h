// A stand-in for XSched's ipc library: many senders to one receiver per channel key, one
// message per datagram (Unix datagram sockets in the abstract namespace, named by the key).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace ipc {

using ChannelKey = std::uint64_t;

enum class NodeType { kSender, kReceiver };

// One received message.
class Message {
public:
    explicit Message(std::vector<char> bytes) : bytes_(std::move(bytes)) {}
    const void *Data() const { return bytes_.data(); }
    std::size_t Size() const { return bytes_.size(); }

private:
    std::vector<char> bytes_;
};

// One end of channel `key`: a receiver owns the channel's name, senders send to it.
class Node {
public:
    Node(ChannelKey key, NodeType type);
    ~Node();
    Node(const Node &) = delete;
    Node &operator=(const Node &) = delete;

    // Sends one message; false when no receiver took it within a few seconds.
    bool Send(const void *data, std::size_t size);
    // Waits for the next message; nullptr once the node is removed (or on an error).
    std::shared_ptr<const Message> Receive();
    // Closes this end; a receiver's Receive() then returns nullptr.
    void Remove();

private:
    ChannelKey key_;
    NodeType type_;
    int fd_ = -1;
    std::atomic<bool> removed_{false};
};

class Channel {
public:
    // Names in the abstract namespace go with their socket: nothing to remove.
    static void Remove(ChannelKey) {}
};

}  // namespace ipc
