#include "train/distributed.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

namespace dflash {

namespace {

/// The integer in environment variable `name`, or `fallback` when it is not set.
int env_int(const char* name, int fallback, int lo) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end || x < lo || x > 1 << 30)
    throw std::invalid_argument(std::string("environment variable ") + name + "=" + v + " is not a valid number");
  return int(x);
}

std::runtime_error sys_error(const std::string& what) { return std::runtime_error(what + ": " + std::strerror(errno)); }

/// A socket closed on scope exit.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  Fd(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
};

double secs_left(std::chrono::steady_clock::time_point end) {
  return std::chrono::duration<double>(end - std::chrono::steady_clock::now()).count();
}

/// Waits until fd is readable (or writable) before `end`; throws on timeout.
void wait_fd(int fd, short events, std::chrono::steady_clock::time_point end, const std::string& what) {
  for (;;) {
    const double left = secs_left(end);
    if (left <= 0) throw std::runtime_error("rendezvous: timed out " + what);
    pollfd p{fd, events, 0};
    const int r = poll(&p, 1, int(std::min(left, 1.0) * 1000) + 1);
    if (r > 0) return;
    if (r < 0 && errno != EINTR) throw sys_error("rendezvous: poll");
  }
}

void send_all(int fd, const void* p, size_t n, std::chrono::steady_clock::time_point end) {
  const char* c = static_cast<const char*>(p);
  while (n) {
    wait_fd(fd, POLLOUT, end, "sending");
    const ssize_t k = send(fd, c, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) throw sys_error("rendezvous: send");
    c += k, n -= size_t(k);
  }
}

void recv_all(int fd, void* p, size_t n, std::chrono::steady_clock::time_point end) {
  char* c = static_cast<char*>(p);
  while (n) {
    wait_fd(fd, POLLIN, end, "waiting for the other processes");
    const ssize_t k = recv(fd, c, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k == 0) throw std::runtime_error("rendezvous: the other side closed the connection");
    if (k < 0) throw sys_error("rendezvous: recv");
    c += k, n -= size_t(k);
  }
}

/// A message: 4-byte tag, 4-byte length, bytes.
void send_msg(int fd, int32_t tag, const std::string& s, std::chrono::steady_clock::time_point end) {
  const int32_t h[2] = {tag, int32_t(s.size())};
  send_all(fd, h, sizeof h, end);
  send_all(fd, s.data(), s.size(), end);
}

std::string recv_msg(int fd, int32_t* tag, std::chrono::steady_clock::time_point end) {
  int32_t h[2];
  recv_all(fd, h, sizeof h, end);
  if (h[1] < 0 || h[1] > (1 << 20)) throw std::runtime_error("rendezvous: a malformed message (another program on the port?)");
  std::string s(size_t(h[1]), '\0');
  recv_all(fd, s.data(), s.size(), end);
  *tag = h[0];
  return s;
}

std::string leader(const ProcessGroup& pg, const std::string& payload, const std::string& check,
                   std::chrono::steady_clock::time_point end) {
  Fd ls(socket(AF_INET, SOCK_STREAM, 0));
  if (ls.fd < 0) throw sys_error("rendezvous: socket");
  const int one = 1;
  setsockopt(ls.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(uint16_t(pg.master_port));
  if (bind(ls.fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
    throw sys_error("rendezvous: rank 0 cannot listen on port " + std::to_string(pg.master_port) +
                    " (set DFLASH_MASTER_PORT to a free port)");
  if (listen(ls.fd, pg.world) != 0) throw sys_error("rendezvous: listen");
  std::vector<Fd> peers;
  std::vector<bool> seen(size_t(pg.world), false);
  std::string problem;
  while (int(peers.size()) < pg.world - 1) {
    wait_fd(ls.fd, POLLIN, end,
            "waiting for " + std::to_string(pg.world - 1 - int(peers.size())) + " more process(es) to connect");
    Fd c(accept(ls.fd, nullptr, nullptr));
    if (c.fd < 0) continue;
    int32_t rank = -1;
    const std::string their = recv_msg(c.fd, &rank, end);
    if (rank <= 0 || rank >= pg.world || seen[size_t(rank)])
      problem = "two processes claim rank " + std::to_string(rank) + ", or it is out of range";
    else if (their != check && problem.empty())
      problem = "rank " + std::to_string(rank) + " runs with " + their + " but rank 0 with " + check;
    if (rank > 0 && rank < pg.world) seen[size_t(rank)] = true;
    peers.push_back(std::move(c));
  }
  for (Fd& p : peers) send_msg(p.fd, problem.empty() ? 0 : 1, problem.empty() ? payload : problem, end);
  if (!problem.empty()) throw std::runtime_error("rendezvous: " + problem);
  return payload;
}

std::string follower(const ProcessGroup& pg, const std::string& check, std::chrono::steady_clock::time_point end) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  const int g = getaddrinfo(pg.master_addr.c_str(), std::to_string(pg.master_port).c_str(), &hints, &res);
  if (g != 0) throw std::runtime_error("rendezvous: cannot resolve DFLASH_MASTER_ADDR " + pg.master_addr + ": " + gai_strerror(g));
  const sockaddr_in addr = *reinterpret_cast<const sockaddr_in*>(res->ai_addr);
  freeaddrinfo(res);
  for (;;) {  // rank 0 may still be starting
    Fd c(socket(AF_INET, SOCK_STREAM, 0));
    if (c.fd < 0) throw sys_error("rendezvous: socket");
    if (connect(c.fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0) {
      send_msg(c.fd, pg.rank, check, end);
      int32_t status = 0;
      const std::string r = recv_msg(c.fd, &status, end);
      if (status != 0) throw std::runtime_error("rendezvous: " + r);
      return r;
    }
    if (secs_left(end) <= 0)
      throw std::runtime_error("rendezvous: timed out connecting to rank 0 at " + pg.master_addr + ":" +
                               std::to_string(pg.master_port) + " (set DFLASH_MASTER_ADDR to rank 0's host)");
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

}  // namespace

ProcessGroup process_group_from_env() {
  ProcessGroup pg;
  struct Source {
    const char *rank, *size, *local, *name;
  };
  for (const Source& s : {Source{"DFLASH_RANK", "DFLASH_WORLD_SIZE", "DFLASH_LOCAL_RANK", "DFLASH_*"},
                          Source{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI"},
                          Source{"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPICH"},
                          Source{"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "Slurm"}}) {
    if (!std::getenv(s.rank) || !std::getenv(s.size)) continue;
    pg.rank = env_int(s.rank, 0, 0);
    pg.world = env_int(s.size, 1, 1);
    pg.local_rank = env_int(s.local, 0, 0);
    pg.launcher = s.name;
    if (pg.rank >= pg.world)
      throw std::invalid_argument(std::string(s.rank) + "=" + std::to_string(pg.rank) + " is not below " + s.size +
                                  "=" + std::to_string(pg.world));
    break;
  }
  if (const char* a = std::getenv("DFLASH_MASTER_ADDR"); a && *a) pg.master_addr = a;
  pg.master_port = env_int("DFLASH_MASTER_PORT", pg.master_port, 1);
  if (pg.master_port > 65535) throw std::invalid_argument("DFLASH_MASTER_PORT must be a TCP port (1..65535)");
  return pg;
}

std::string rendezvous(const ProcessGroup& pg, const std::string& payload, const std::string& check, double timeout_s) {
  if (pg.world <= 1) return payload;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                          std::chrono::duration<double>(timeout_s));
  return pg.rank == 0 ? leader(pg, payload, check, end) : follower(pg, check, end);
}

}  // namespace dflash
