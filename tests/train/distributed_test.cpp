// Multi-process start-up (src/train/distributed.h): ranks from the launchers' environments, and the
// rendezvous (ranks as threads on localhost): the payload reaches every rank, a rank with another
// run shape makes every rank fail naming it, a missing rank times out.
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <thread>
#include <vector>

#include "train/distributed.h"

using namespace dflash;

namespace {

int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t n = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  close(fd);
  return ntohs(a.sin_port);
}

/// Runs rank r = 0..world-1 of a rendezvous on threads; returns each rank's payload or "error: ...".
std::vector<std::string> run_ranks(int world, const std::function<std::string(int)>& check, double timeout_s,
                                   int skip_rank = -1) {
  const int port = free_port();
  std::vector<std::string> got(static_cast<size_t>(world));
  std::vector<std::thread> th;
  for (int r = 0; r < world; ++r) {
    if (r == skip_rank) continue;
    th.emplace_back([&, r] {
      ProcessGroup pg;
      pg.rank = r, pg.world = world, pg.master_port = port;
      try {
        got[size_t(r)] = rendezvous(pg, r == 0 ? std::string("nccl-id\0bytes", 13) : "", check(r), timeout_s);
      } catch (const std::exception& e) {
        got[size_t(r)] = std::string("error: ") + e.what();
      }
    });
  }
  for (auto& t : th) t.join();
  return got;
}

struct Env {
  std::vector<std::string> names;
  void set(const char* k, const char* v) {
    setenv(k, v, 1);
    names.push_back(k);
  }
  ~Env() {
    for (const auto& n : names) unsetenv(n.c_str());
  }
};

}  // namespace

TEST(Distributed, RanksFromTheLaunchersEnvironment) {
  for (const char* k : {"DFLASH_RANK", "DFLASH_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK",
                        "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS"})
    ASSERT_EQ(std::getenv(k), nullptr) << k << " is set in the test environment";
  EXPECT_EQ(process_group_from_env().world, 1);
  {
    Env e;
    e.set("OMPI_COMM_WORLD_RANK", "1"), e.set("OMPI_COMM_WORLD_SIZE", "2"), e.set("OMPI_COMM_WORLD_LOCAL_RANK", "1");
    e.set("DFLASH_MASTER_ADDR", "node0"), e.set("DFLASH_MASTER_PORT", "31000");
    const ProcessGroup pg = process_group_from_env();
    EXPECT_EQ(pg.rank, 1);
    EXPECT_EQ(pg.world, 2);
    EXPECT_EQ(pg.local_rank, 1);
    EXPECT_EQ(pg.launcher, "Open MPI");
    EXPECT_EQ(pg.master_addr, "node0");
    EXPECT_EQ(pg.master_port, 31000);
  }
  {
    Env e;
    e.set("SLURM_PROCID", "3"), e.set("SLURM_NTASKS", "2");
    try {
      process_group_from_env();
      FAIL() << "rank 3 of 2 accepted";
    } catch (const std::invalid_argument& ex) {
      EXPECT_NE(std::string(ex.what()).find("SLURM_PROCID=3"), std::string::npos) << ex.what();
    }
  }
  {
    Env e;
    e.set("DFLASH_RANK", "x"), e.set("DFLASH_WORLD_SIZE", "2");
    EXPECT_THROW(process_group_from_env(), std::invalid_argument);
  }
}

TEST(Distributed, RendezvousHandsEveryRankThePayload) {
  const auto got = run_ranks(3, [](int) { return "2 drafter GPUs"; }, 20);
  for (const auto& g : got) EXPECT_EQ(g, std::string("nccl-id\0bytes", 13));
}

TEST(Distributed, RendezvousRefusesAnotherRunShapeOnEveryRank) {
  const auto got = run_ranks(3, [](int r) { return r == 2 ? "1 drafter GPU" : "2 drafter GPUs"; }, 20);
  for (const auto& g : got) {
    EXPECT_EQ(g.rfind("error: ", 0), 0u) << g;
    EXPECT_NE(g.find("rank 2 runs with 1 drafter GPU but rank 0 with 2 drafter GPUs"), std::string::npos) << g;
  }
}

TEST(Distributed, RendezvousTimesOutWithoutAllRanks) {
  const auto got = run_ranks(3, [](int) { return "same"; }, 1.0, /*skip_rank=*/2);
  EXPECT_NE(got[0].find("timed out waiting for 1 more process"), std::string::npos) << got[0];
  EXPECT_NE(got[1].find("error: "), std::string::npos) << got[1];
}
