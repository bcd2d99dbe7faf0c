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
    /// Whether the launcher's variables show ranks on more than one host (`LOCAL_WORLD_SIZE` or
    /// `OMPI_COMM_WORLD_LOCAL_SIZE` below the world size, more than one node under Slurm). Then rank 0's
    /// store must be on an address the other hosts reach: `MASTER_ADDR` must be set (Slurm: or derived) and
    /// must not be a loopback address.
    pub multi_host: bool,
    /// Host of rank 0's rendezvous store: `MASTER_ADDR`; unset, under Slurm with several nodes the first host
    /// of the step's node list, else `127.0.0.1`.
    pub master_addr: String,
    /// Port of the store: `MASTER_PORT`; unset, under Slurm a port derived from the job and step ids (see
    /// [`Bootstrap::from_env`]), else 29500.
    pub master_port: u16,
    /// Secret every process presents to the store (`LONGCTX_JOB_TOKEN`).
    pub token: String,
    /// Whether the store is already served at `master_addr:master_port` by something other than the ranks
    /// (`LONGCTX_STORE_HOSTED=1`: `longctx-launch` does when it picks the port itself, so that the port is held
    /// from the start rather than found free and taken later); else rank 0 hosts it.
    pub store_hosted: bool,
}

/// The launcher whose variables gave the rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scheme {
    Torchrun,
    Slurm,
    OpenMpi,
    /// MPICH and Intel MPI (Hydra's process manager).
    Hydra,
}

impl Bootstrap {
    /// Reads the environment of `longctx-launch`/torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `LOCAL_WORLD_SIZE`), Slurm (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, the node count and list),
    /// Open MPI (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`,
    /// `OMPI_COMM_WORLD_LOCAL_SIZE`) or MPICH / Intel MPI (`PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`,
    /// `MPI_LOCALNRANKS`), in that order of preference, plus `MASTER_ADDR`, `MASTER_PORT` and
    /// `LONGCTX_JOB_TOKEN` (and `LONGCTX_STORE_HOSTED`, see [`Bootstrap::store_hosted`]).
    ///
    /// Under Slurm or `mpirun`, export a token shared by the job, e.g. `export LONGCTX_JOB_TOKEN=$(openssl rand
    /// -hex 16)` before `srun`. Under Slurm, `MASTER_ADDR` may be left unset: on several nodes it is the first
    /// host of `SLURM_STEP_NODELIST` (or `SLURM_JOB_NODELIST`), where Slurm's default block distribution puts
    /// task 0; `MASTER_PORT` may be left unset too: `20000 + 10 * (SLURM_JOB_ID % 1000) + SLURM_STEP_ID % 10`,
    /// so that jobs and steps sharing a node do not collide. Under `mpirun` on several hosts, export
    /// `MASTER_ADDR` (`mpirun -x MASTER_ADDR -x LONGCTX_JOB_TOKEN`); a job the variables show on several hosts
    /// without one is an error rather than a wait on `127.0.0.1`.
    pub fn from_env() -> Result<Bootstrap, CommError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Like [`from_env`](Self::from_env) over any variable lookup (for tests and embedding).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Bootstrap, CommError> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let num = |k: &str| -> Result<Option<usize>, CommError> {
            get(k)
                .map(|v| {
                    v.trim().parse::<usize>().map_err(|_| CommError::Bootstrap(format!("{k}={v:?} is not a number")))
                })
                .transpose()
        };
        let first_num = |keys: &[&str]| -> Result<Option<usize>, CommError> {
            for k in keys {
                if let Some(v) = num(k)? {
                    return Ok(Some(v));
                }
            }
            Ok(None)
        };
        // Each scheme's rank, world size and local rank, and (but for Slurm, which counts nodes) how many of the
        // ranks share this host.
        let schemes = [
            (Scheme::Torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK", Some("LOCAL_WORLD_SIZE")),
            (Scheme::Slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
            (
                Scheme::OpenMpi,
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                Some("OMPI_COMM_WORLD_LOCAL_SIZE"),
            ),
            (Scheme::Hydra, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", Some("MPI_LOCALNRANKS")),
        ];
        let mut found = None;
        for (scheme, r, w, l, local_size) in schemes {
            if let (Some(rank), Some(world)) = (num(r)?, num(w)?) {
                found = Some((rank, world, num(l)?.unwrap_or(0), scheme, w, local_size));
                break;
            }
        }
        let (rank, world_size, local_rank, scheme, world_var, local_size_var) = found.ok_or_else(|| {
            CommError::Bootstrap(
                "no rank in the environment: set RANK and WORLD_SIZE (longctx-launch does), or run under Slurm or mpirun"
                    .into(),
            )
        })?;
        if world_size == 0 || rank >= world_size {
            return Err(CommError::Bootstrap(format!("rank {rank} is not in a world of {world_size}")));
        }
        let (multi_host, spread) = match local_size_var {
            Some(var) => match num(var)? {
                Some(l) => (l < world_size, format!("{var}={l} of {world_var}={world_size}")),
                None => (false, String::new()),
            },
            None => match first_num(&["SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"])? {
                Some(n) => (n > 1, format!("{n} Slurm nodes")),
                None => (false, String::new()),
            },
        };
        let master_addr = match get("MASTER_ADDR") {
            Some(a) => a.trim().to_string(),
            None if multi_host && scheme == Scheme::Slurm => {
                let (var, list) = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]
                    .into_iter()
                    .find_map(|k| get(k).map(|v| (k, v)))
                    .ok_or_else(|| {
                        CommError::Bootstrap(format!(
                            "the job spans {spread}, MASTER_ADDR is not set and Slurm gave no node list: export \
                             MASTER_ADDR=<host of rank 0>"
                        ))
                    })?;
                let hosts =
                    crate::hostlist::expand_hostlist(&list).map_err(|e| CommError::Bootstrap(format!("{var}: {e}")))?;
                hosts.into_iter().next().unwrap_or_default()
            }
            None if multi_host => {
                return Err(CommError::Bootstrap(format!(
                    "the job spans several hosts ({spread}) but MASTER_ADDR is not set: export MASTER_ADDR=<an \
                     address of rank 0's host that the other hosts reach> to every rank"
                )))
            }
            None => "127.0.0.1".into(),
        };
        let master_port = match get("MASTER_PORT") {
            Some(p) => {
                p.trim().parse().map_err(|_| CommError::Bootstrap(format!("MASTER_PORT={p:?} is not a port")))?
            }
            None if scheme == Scheme::Slurm => match num("SLURM_JOB_ID")? {
                Some(job) => slurm_port(job, num("SLURM_STEP_ID").ok().flatten().unwrap_or(0)),
                None => DEFAULT_MASTER_PORT,
            },
            None => DEFAULT_MASTER_PORT,
        };
        let token = get("LONGCTX_JOB_TOKEN")
            .ok_or_else(|| CommError::Bootstrap("LONGCTX_JOB_TOKEN is not set (longctx-launch sets it)".into()))?;
        let store_hosted = match get("LONGCTX_STORE_HOSTED").as_deref().map(str::trim) {
            None | Some("0") => false,
            Some("1") => true,
            Some(v) => return Err(CommError::Bootstrap(format!("LONGCTX_STORE_HOSTED={v:?} is not 0 or 1"))),
        };
        Ok(Bootstrap { rank, world_size, local_rank, multi_host, master_addr, master_port, token, store_hosted })
    }

    /// The store's socket address (resolves `master_addr`). In a job on several hosts, an address that resolves
    /// to loopback is an error: the other hosts could not reach the store there (a host name that `/etc/hosts`
    /// maps to `127.0.1.1` is the usual way to get one).
    pub fn master_socket(&self) -> Result<SocketAddr, CommError> {
        let addr = (self.master_addr.as_str(), self.master_port)
            .to_socket_addrs()
            .map_err(|e| CommError::io(format!("resolving MASTER_ADDR {}", self.master_addr), e))?
            .next()
            .ok_or_else(|| CommError::Bootstrap(format!("MASTER_ADDR {} has no address", self.master_addr)))?;
        if self.multi_host && addr.ip().is_loopback() {
            return Err(CommError::Bootstrap(format!(
                "MASTER_ADDR {} resolves to {}, a loopback address, but the job spans several hosts: set \
                 MASTER_ADDR to an address of rank 0's host that the other hosts reach",
                self.master_addr,
                addr.ip()
            )));
        }
        Ok(addr)
    }
}

/// Slurm's default store port: distinct for up to 1000 concurrent jobs (by id) with up to 10 steps each, in
/// 20000..30000, below Linux's ephemeral ports.
fn slurm_port(job_id: usize, step_id: usize) -> u16 {
    (20000 + 10 * (job_id % 1000) + step_id % 10) as u16
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
    fn the_store_is_rank_0s_unless_the_launcher_says_it_hosts_it() {
        let base = [("RANK", "1"), ("WORLD_SIZE", "2"), ("LONGCTX_JOB_TOKEN", "t")];
        assert!(!Bootstrap::from_lookup(env(&base)).unwrap().store_hosted);
        for (v, hosted) in [("1", true), ("0", false)] {
            let b = Bootstrap::from_lookup(env(&[&base[..], &[("LONGCTX_STORE_HOSTED", v)]].concat())).unwrap();
            assert_eq!(b.store_hosted, hosted);
        }
        let e = Bootstrap::from_lookup(env(&[&base[..], &[("LONGCTX_STORE_HOSTED", "yes")]].concat())).unwrap_err();
        assert!(e.to_string().contains("LONGCTX_STORE_HOSTED=\"yes\""), "{e}");
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
        assert!(Bootstrap::from_lookup(env(&[("RANK", "0"), ("WORLD_SIZE", "4"), ("LONGCTX_JOB_TOKEN", "")])).is_err());
    }

    fn err(pairs: &[(&str, &str)]) -> String {
        Bootstrap::from_lookup(env(pairs)).expect_err("accepted").to_string()
    }

    #[test]
    fn one_host_jobs_default_to_loopback() {
        for pairs in [
            &[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "4")][..],
            &[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "4"), ("SLURM_NNODES", "1"), ("SLURM_JOB_NODELIST", "n7")],
            &[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "4"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "4")],
        ] {
            let b = Bootstrap::from_lookup(env(&[pairs, &[("LONGCTX_JOB_TOKEN", "t")]].concat())).unwrap();
            assert!(!b.multi_host, "{pairs:?}");
            assert_eq!(b.master_addr, "127.0.0.1", "{pairs:?}");
            assert!(b.master_socket().unwrap().ip().is_loopback());
        }
    }

    #[test]
    fn slurm_on_several_nodes_finds_rank_0s_host_and_a_port_per_step() {
        let slurm = [
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NNODES", "4"),
            ("SLURM_JOB_NODELIST", "gpu[001-004]"),
            ("SLURM_STEP_NODELIST", "gpu[003-004],cpu1"),
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_STEP_ID", "2"),
            ("LONGCTX_JOB_TOKEN", "t"),
        ];
        let b = Bootstrap::from_lookup(env(&slurm)).unwrap();
        assert!(b.multi_host);
        assert_eq!((b.rank, b.world_size, b.local_rank), (5, 8, 1));
        assert_eq!(b.master_addr, "gpu003", "the step's first node");
        assert_eq!(b.master_port, 20000 + 10 * 456 + 2);
        let b = Bootstrap::from_lookup(env(&slurm[..6])).err().unwrap().to_string();
        assert!(b.contains("LONGCTX_JOB_TOKEN"), "{b}");
        // The job's list when the step has none; MASTER_ADDR and MASTER_PORT win over both.
        let mut v = slurm.to_vec();
        v.retain(|(k, _)| *k != "SLURM_STEP_NODELIST");
        assert_eq!(Bootstrap::from_lookup(env(&v)).unwrap().master_addr, "gpu001");
        v.extend([("MASTER_ADDR", "10.1.2.3"), ("MASTER_PORT", "4000")]);
        let b = Bootstrap::from_lookup(env(&v)).unwrap();
        assert_eq!((b.master_addr.as_str(), b.master_port), ("10.1.2.3", 4000));
        // No list at all, or a broken one: errors that say what to set.
        v.retain(|(k, _)| !["SLURM_JOB_NODELIST", "MASTER_ADDR"].contains(k));
        assert!(err(&v).contains("MASTER_ADDR"), "{}", err(&v));
        v.push(("SLURM_JOB_NODELIST", "gpu[001-"));
        assert!(err(&v).contains("SLURM_JOB_NODELIST"), "{}", err(&v));
    }

    #[test]
    fn reads_mpich_and_intel_mpi() {
        let b = Bootstrap::from_lookup(env(&[
            ("PMI_RANK", "2"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "0"),
            ("MPI_LOCALNRANKS", "2"),
            ("MASTER_ADDR", "10.0.0.9"),
            ("LONGCTX_JOB_TOKEN", "t"),
        ]))
        .unwrap();
        assert_eq!((b.rank, b.world_size, b.local_rank, b.multi_host), (2, 4, 0, true));
        let e = err(&[("PMI_RANK", "2"), ("PMI_SIZE", "4"), ("MPI_LOCALNRANKS", "2"), ("LONGCTX_JOB_TOKEN", "t")]);
        assert!(e.contains("MPI_LOCALNRANKS=2 of PMI_SIZE=4"), "{e}");
    }

    #[test]
    fn several_hosts_without_master_addr_is_an_error_not_loopback() {
        let torchrun = [("RANK", "0"), ("WORLD_SIZE", "8"), ("LOCAL_WORLD_SIZE", "4"), ("LONGCTX_JOB_TOKEN", "t")];
        let ompi = [
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("LONGCTX_JOB_TOKEN", "t"),
        ];
        for pairs in [&torchrun[..], &ompi[..]] {
            let e = err(pairs);
            assert!(e.contains("MASTER_ADDR is not set") && e.contains("several hosts"), "{e}");
            // A loopback MASTER_ADDR is refused when resolved, on every rank, naming the address.
            let b = Bootstrap::from_lookup(env(&[pairs, &[("MASTER_ADDR", "127.0.0.1")]].concat())).unwrap();
            let e = b.master_socket().unwrap_err().to_string();
            assert!(e.contains("loopback") && e.contains("127.0.0.1"), "{e}");
            let b = Bootstrap::from_lookup(env(&[pairs, &[("MASTER_ADDR", "192.0.2.7")]].concat())).unwrap();
            assert_eq!(b.master_socket().unwrap().to_string(), "192.0.2.7:29500");
        }
    }
}
