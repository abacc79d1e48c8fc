// Several training processes (one per node, or one per group of GPUs), started by mpirun, srun or
// by hand: where this process stands, and the start-up rendezvous through which rank 0 hands every
// process the NCCL id (MPI, where it starts the processes, is only the launcher; no MPI library is
// linked). Plain POSIX TCP sockets.
#pragma once
#include <string>

namespace dflash {

/// This process's place in a multi-process run.
struct ProcessGroup {
  int rank = 0, world = 1;   // global rank and number of processes
  int local_rank = 0;        // rank among the processes of this node (picks its GPUs)
  std::string master_addr = "127.0.0.1";  // where rank 0 listens (DFLASH_MASTER_ADDR)
  int master_port = 29517;                // (DFLASH_MASTER_PORT)
  std::string launcher = "none";          // which environment gave the ranks
};

/// From the environment: DFLASH_RANK / DFLASH_WORLD_SIZE / DFLASH_LOCAL_RANK, else Open MPI's
/// OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK, else MPICH's PMI_RANK / PMI_SIZE / MPI_LOCALRANKID,
/// else Slurm's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; none: a single process. Throws
/// std::invalid_argument naming the variable for a value that is not a number or out of range.
ProcessGroup process_group_from_env();

/// The start-up handshake. Rank 0 listens on 0.0.0.0:master_port and waits for the other world - 1
/// ranks, which connect to master_addr:master_port (retrying until `timeout_s`) and send their rank
/// and `check`; when every rank sent rank 0's own `check` (the run's shape: GPUs per process, ...),
/// rank 0 sends them `payload` and every rank returns it. Otherwise every rank throws
/// std::runtime_error naming the rank and both values; timeouts and socket errors throw too.
std::string rendezvous(const ProcessGroup& pg, const std::string& payload, const std::string& check, double timeout_s);

}  // namespace dflash
