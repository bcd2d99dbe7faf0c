//! Where a process sits in a job, read from the environment of the launcher that started it.

use std::net::{SocketAddr, ToSocketAddrs};

use crate::CommError;

/// Default rendezvous port when `MASTER_PORT` is unset.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// A process's place in a multi-process job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    /// Global rank.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Rank among the processes of this host.
    pub local_rank: usize,
    /// Host of rank 0's rendezvous store (`MASTER_ADDR`, default `127.0.0.1`).
    pub master_addr: String,
    /// Port of the store (`MASTER_PORT`, default 29500).
    pub master_port: u16,
    /// Secret every process presents to the store (`LONGCTX_JOB_TOKEN`).
    pub token: String,
}

impl Bootstrap {
    /// Reads the environment of `longctx-launch`/torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`), Slurm
    /// (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`) or Open MPI (`OMPI_COMM_WORLD_RANK`,
    /// `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`), in that order of preference, plus `MASTER_ADDR`,
    /// `MASTER_PORT` and `LONGCTX_JOB_TOKEN`. Under Slurm or `mpirun`, export `MASTER_ADDR` and a token shared by
    /// the job, e.g. `export LONGCTX_JOB_TOKEN=$(openssl rand -hex 16)` before `srun`.
    pub fn from_env() -> Result<Bootstrap, CommError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Like [`from_env`](Self::from_env) over any variable lookup (for tests and embedding).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Bootstrap, CommError> {
        let num = |k: &str| -> Result<Option<usize>, CommError> {
            get(k)
                .map(|v| {
                    v.trim().parse::<usize>().map_err(|_| CommError::Bootstrap(format!("{k}={v:?} is not a number")))
                })
                .transpose()
        };
        let schemes = [
            ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
            ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ];
        let mut found = None;
        for (r, w, l) in schemes {
            if let (Some(rank), Some(world)) = (num(r)?, num(w)?) {
                found = Some((rank, world, num(l)?.unwrap_or(0), r));
                break;
            }
        }
        let (rank, world_size, local_rank, _) = found.ok_or_else(|| {
            CommError::Bootstrap(
                "no rank in the environment: set RANK and WORLD_SIZE (longctx-launch does), or run under Slurm or mpirun"
                    .into(),
            )
        })?;
        if world_size == 0 || rank >= world_size {
            return Err(CommError::Bootstrap(format!("rank {rank} is not in a world of {world_size}")));
        }
        let master_port = match get("MASTER_PORT") {
            Some(p) => {
                p.trim().parse().map_err(|_| CommError::Bootstrap(format!("MASTER_PORT={p:?} is not a port")))?
            }
            None => DEFAULT_MASTER_PORT,
        };
        let token = get("LONGCTX_JOB_TOKEN")
            .filter(|t| !t.is_empty())
            .ok_or_else(|| CommError::Bootstrap("LONGCTX_JOB_TOKEN is not set (longctx-launch sets it)".into()))?;
        Ok(Bootstrap {
            rank,
            world_size,
            local_rank,
            master_addr: get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
            master_port,
            token,
        })
    }

    /// The store's socket address (resolves `master_addr`).
    pub fn master_socket(&self) -> Result<SocketAddr, CommError> {
        (self.master_addr.as_str(), self.master_port)
            .to_socket_addrs()
            .map_err(|e| CommError::io(format!("resolving MASTER_ADDR {}", self.master_addr), e))?
            .next()
            .ok_or_else(|| CommError::Bootstrap(format!("MASTER_ADDR {} has no address", self.master_addr)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn reads_each_launcher_scheme() {
        let b = Bootstrap::from_lookup(env(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_PORT", "1234"),
            ("LONGCTX_JOB_TOKEN", "t"),
        ]))
        .unwrap();
        assert_eq!((b.rank, b.world_size, b.local_rank, b.master_port), (2, 4, 1, 1234));
        let b = Bootstrap::from_lookup(env(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "3"),
            ("LONGCTX_JOB_TOKEN", "t"),
        ]))
        .unwrap();
        assert_eq!((b.rank, b.world_size, b.local_rank, b.master_port), (3, 8, 3, DEFAULT_MASTER_PORT));
        let b = Bootstrap::from_lookup(env(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("LONGCTX_JOB_TOKEN", "t"),
        ]))
        .unwrap();
        assert_eq!((b.rank, b.world_size, b.master_addr.as_str()), (0, 2, "10.0.0.1"));
    }

    #[test]
    fn rejects_bad_environments() {
        assert!(Bootstrap::from_lookup(env(&[])).is_err());
        assert!(Bootstrap::from_lookup(env(&[("RANK", "4"), ("WORLD_SIZE", "4"), ("LONGCTX_JOB_TOKEN", "t")])).is_err());
        assert!(Bootstrap::from_lookup(env(&[("RANK", "x"), ("WORLD_SIZE", "4"), ("LONGCTX_JOB_TOKEN", "t")])).is_err());
        assert!(Bootstrap::from_lookup(env(&[("RANK", "0"), ("WORLD_SIZE", "4")])).is_err(), "token required");
    }
}
