//! Unit tests of the doctor's verdicts: a healthy EFA node, then each
//! failure injected into its facts.
use super::*;
use crate::doctor::facts::{ClockProbe, RdmaDevice, RouterProbe, UprobeProbe};

fn efa_dev() -> RdmaDevice {
    RdmaDevice {
        name: "rdmap16s27".into(),
        driver: Some("efa".into()),
        counters: Ok(40),
    }
}

fn all_caps() -> u64 {
    [
        cap::IPC_LOCK,
        cap::SYS_PTRACE,
        cap::SYS_ADMIN,
        cap::PERFMON,
        cap::BPF,
    ]
    .iter()
    .fold(0, |a, c| a | (1 << c))
}

fn healthy() -> Facts {
    Facts {
        fi_providers: Ok(vec![
            "efa".into(),
            "tcp".into(),
            "ofi_rxm".into(),
            "shm".into(),
        ]),
        backend: (
            Backend::Libfabric {
                provider: "efa".into(),
            },
            "agent.toml".into(),
        ),
        rdma_devices: Ok(vec![efa_dev()]),
        efa_use_device_rdma: Some("1".into()),
        nixl_plugin_dir: Some("/opt/nixl/plugins".into()),
        nixl_plugins: Ok(vec!["LIBFABRIC".into(), "UCX".into()]),
        engine_plugins: Some((42, Ok(vec!["LIBFABRIC".into()]))),
        memlock_bytes: Some(8 << 20),
        hugepages_total: Some(1024),
        cap_eff: all_caps(),
        kernel: Some((6, 18)),
        btf: true,
        tracefs: Some("/sys/kernel/tracing".into()),
        uprobe: Some(UprobeProbe {
            pid: 42,
            target: "/proc/42/root/usr/lib/libnixl.so".into(),
            result: Ok(vec!["a".into(), "b".into()]),
        }),
        side_channels: Ok(vec![(
            "probe.node-a".into(),
            "10.0.0.1:5600".parse().unwrap(),
        )]),
        peers: vec![("node-b".into(), "10.0.0.2:9470".parse().unwrap())],
        routers: vec![RouterProbe {
            url: "http://10.0.0.9:8000".into(),
            health: Ok(200),
            token_set: true,
            token: Ok(400),
        }],
        clocks: vec![ClockProbe {
            peer: "node-b".into(),
            offset: Ok((120.0, 501.0)),
        }],
    }
}

fn level_of(f: &Facts, name: &str) -> Level {
    all(f).into_iter().find(|c| c.name == name).unwrap().level
}

#[test]
fn a_healthy_efa_node_passes_every_check() {
    let checks = all(&healthy());
    for c in &checks {
        assert_eq!(c.level, Level::Pass, "{c:?}");
        assert!(c.fix.is_none());
    }
    assert_eq!(worst(&checks).exit_code(), 0);
}

#[test]
fn exit_status_follows_the_worst_level() {
    let mut f = healthy();
    f.btf = false;
    let checks = all(&f);
    assert_eq!(worst(&checks), Level::Fail);
    assert_eq!(worst(&checks).exit_code(), 2);
    let mut f = healthy();
    f.hugepages_total = Some(0);
    assert_eq!(worst(&all(&f)).exit_code(), 1);
    assert_eq!(Level::Skip.exit_code(), 0);
}

#[test]
fn libfabric_fails_when_the_chosen_provider_is_missing() {
    let mut f = healthy();
    f.fi_providers = Ok(vec!["tcp".into(), "ofi_rxm".into()]);
    let c = libfabric(&f);
    assert_eq!(c.level, Level::Fail);
    assert!(c.detail.contains("lacks efa"), "{}", c.detail);
    f.fi_providers = Err("fi_info: not found".into());
    assert_eq!(libfabric(&f).level, Level::Warn);
}

#[test]
fn libfabric_warns_when_tcp_is_chosen_on_an_efa_node() {
    let mut f = healthy();
    f.backend.0 = Backend::Libfabric {
        provider: "tcp;ofi_rxm".into(),
    };
    let c = libfabric(&f);
    assert_eq!(c.level, Level::Warn);
    assert!(c.fix.unwrap().contains("provider = \"efa\""));
    f.rdma_devices = Ok(vec![]);
    assert_eq!(libfabric(&f).level, Level::Pass);
}

#[test]
fn no_efa_device_is_a_warning_not_a_failure() {
    let mut f = healthy();
    f.rdma_devices = Ok(vec![]);
    let c = efa(&f);
    assert_eq!(c.level, Level::Warn);
    assert!(c.detail.contains("no EFA device"));
    assert_eq!(rdma_read(&f).level, Level::Warn);
    let mut f = healthy();
    f.rdma_devices = Ok(vec![RdmaDevice {
        counters: Err("Permission denied".into()),
        ..efa_dev()
    }]);
    assert_eq!(efa(&f).level, Level::Warn);
}

#[test]
fn emulated_rdma_read_fails() {
    let mut f = healthy();
    f.efa_use_device_rdma = Some("0".into());
    assert_eq!(rdma_read(&f).level, Level::Fail);
    f.efa_use_device_rdma = None;
    assert_eq!(rdma_read(&f).level, Level::Warn);
}

#[test]
fn missing_plugin_directory_fails_with_a_nixl_backend() {
    let mut f = healthy();
    f.backend.0 = Backend::Nixl {
        plugin: "LIBFABRIC".into(),
    };
    f.nixl_plugins = Err("No such file or directory (os error 2)".into());
    let c = nixl_plugins(&f);
    assert_eq!(c.level, Level::Fail);
    assert!(c.fix.unwrap().contains("NIXL_PLUGIN_DIR"));
    f.nixl_plugin_dir = None;
    assert_eq!(nixl_plugins(&f).level, Level::Fail);
    // Without NIXL in use a missing directory only warns.
    f.backend.0 = Backend::Libfabric {
        provider: "efa".into(),
    };
    assert_eq!(nixl_plugins(&f).level, Level::Warn);
    // The configured plugin missing from the directory.
    let mut f = healthy();
    f.backend.0 = Backend::Nixl {
        plugin: "LIBFABRIC".into(),
    };
    f.nixl_plugins = Ok(vec!["UCX".into()]);
    assert_eq!(nixl_plugins(&f).level, Level::Fail);
}

#[test]
fn ucx_on_efa_fails_and_is_fine_without_efa() {
    let mut f = healthy();
    f.engine_plugins = Some((42, Ok(vec!["UCX".into()])));
    let c = engine_backend(&f);
    assert_eq!(c.level, Level::Fail);
    assert!(c.detail.contains("pid 42: UCX"), "{}", c.detail);
    f.rdma_devices = Ok(vec![]);
    assert_eq!(engine_backend(&f).level, Level::Pass);
    let mut f = healthy();
    f.engine_plugins = None;
    f.backend.0 = Backend::Nixl {
        plugin: "UCX".into(),
    };
    assert_eq!(engine_backend(&f).level, Level::Fail);
    f.backend.0 = Backend::Libfabric {
        provider: "efa".into(),
    };
    assert_eq!(engine_backend(&f).level, Level::Skip);
}

#[test]
fn memlock_without_ipc_lock_fails_on_efa() {
    let mut f = healthy();
    f.cap_eff &= !(1 << cap::IPC_LOCK);
    assert_eq!(memlock(&f).level, Level::Fail);
    f.memlock_bytes = None;
    assert_eq!(memlock(&f).level, Level::Pass);
    f.memlock_bytes = Some(64 << 10);
    f.rdma_devices = Ok(vec![]);
    let c = memlock(&f);
    assert_eq!(c.level, Level::Warn);
    assert!(c.detail.contains("64 KiB"), "{}", c.detail);
}

#[test]
fn no_hugepages_warns_on_efa_only() {
    let mut f = healthy();
    f.hugepages_total = Some(0);
    assert_eq!(hugepages(&f).level, Level::Warn);
    f.rdma_devices = Ok(vec![]);
    assert_eq!(hugepages(&f).level, Level::Pass);
}

#[test]
fn sys_admin_dropped_fails_on_6_16_and_not_before() {
    let mut f = healthy();
    f.cap_eff &= !(1 << cap::SYS_ADMIN);
    let c = capabilities(&f);
    assert_eq!(c.level, Level::Fail);
    assert!(c.detail.contains("CAP_SYS_ADMIN"), "{}", c.detail);
    assert!(c.detail.contains("6.16"), "{}", c.detail);
    f.kernel = Some((6, 15));
    assert_eq!(capabilities(&f).level, Level::Pass);
    f.cap_eff &= !(1 << cap::BPF);
    assert_eq!(capabilities(&f).level, Level::Fail);
    let mut f = healthy();
    f.cap_eff &= !(1 << cap::SYS_PTRACE);
    assert_eq!(capabilities(&f).level, Level::Warn);
    f.cap_eff = 0;
    assert!(capabilities(&f).detail.contains("cannot load"));
}

#[test]
fn btf_and_tracefs_missing_fail() {
    let mut f = healthy();
    f.tracefs = None;
    assert_eq!(tracefs(&f).level, Level::Fail);
    f.btf = false;
    assert_eq!(btf(&f).level, Level::Fail);
}

#[test]
fn uprobe_attach_refused_fails_and_names_sys_admin() {
    let mut f = healthy();
    f.uprobe.as_mut().unwrap().result = Err("perf_event_open failed: Permission denied".into());
    let c = uprobes(&f);
    assert_eq!(c.level, Level::Fail);
    assert!(c.fix.unwrap().contains("CAP_SYS_ADMIN"));
    f.uprobe = None;
    assert_eq!(uprobes(&f).level, Level::Skip);
}

#[test]
fn loopback_side_channel_fails_while_peers_are_elsewhere() {
    let mut f = healthy();
    f.side_channels = Ok(vec![(
        "probe.node-a".into(),
        "127.0.0.1:5600".parse().unwrap(),
    )]);
    let c = side_channels(&f);
    assert_eq!(c.level, Level::Fail);
    assert!(c.detail.contains("node-b"), "{}", c.detail);
    assert!(c.fix.unwrap().contains("node_addr"));
    // Every peer local: loopback is right.
    f.peers = vec![("node-b".into(), "127.0.0.1:9471".parse().unwrap())];
    assert_eq!(side_channels(&f).level, Level::Pass);
    f.side_channels = Ok(vec![("e".into(), "0.0.0.0:5600".parse().unwrap())]);
    assert_eq!(side_channels(&f).level, Level::Fail);
}

#[test]
fn wrong_router_token_and_unreachable_router_fail() {
    let mut f = healthy();
    f.routers[0].token = Ok(401);
    let c = routers(&f);
    assert_eq!(c.level, Level::Fail);
    assert!(c.detail.contains("token refused"), "{}", c.detail);
    f.routers[0].health = Err("connection refused".into());
    assert!(routers(&f).detail.contains("unreachable"));
    f.routers.clear();
    assert_eq!(routers(&f).level, Level::Warn);
}

#[test]
fn clock_offset_beyond_its_uncertainty_warns() {
    let mut f = healthy();
    f.clocks[0].offset = Ok((-3200.0, 510.0));
    let c = clocks(&f);
    assert_eq!(c.level, Level::Warn);
    assert!(c.detail.contains("-3200 ms"), "{}", c.detail);
    f.clocks[0].offset = Ok((1400.0, 510.0));
    assert_eq!(level_of(&f, "clock"), Level::Pass);
    f.clocks[0].offset = Err("connection refused".into());
    assert_eq!(clocks(&f).level, Level::Warn);
}
