# NixOS module: services.glm53 runs `glm53 serve` as a Type=notify systemd service, with the
# same readiness, limits and hardening as packaging/systemd/glm53.service. Settings reach the
# server as GLM53_* variables (docs/reference.md lists them all).
self:
{ config, lib, pkgs, ... }:

let
  cfg = config.services.glm53;
  inherit (lib) mkOption mkEnableOption mkIf types;
  system = pkgs.stdenv.hostPlatform.system;
  # { NAME = value; } when the option is set, {} when it is null
  setIf = name: value: lib.optionalAttrs (value != null) { ${name} = toString value; };
  # services.glm53.instances, or the one service the top-level options describe
  instances =
    if cfg.instances != [ ] then cfg.instances
    else [ { gpu = null; inherit (cfg) port cpus cpuAffinity; numaNode = null; } ];
  serviceName = inst: if inst.gpu == null then "glm53" else "glm53-gpu${toString inst.gpu}";
  service = inst: {
    description = "glm53 OpenAI-compatible GLM-5.3-Flash server"
      + lib.optionalString (inst.gpu != null) " on GPU ${toString inst.gpu}";
    wantedBy = [ "multi-user.target" ];
    wants = [ "network-online.target" ];
    after = [ "network-online.target" ];
    startLimitIntervalSec = 3600;
    startLimitBurst = 3;

    environment = {
      GLM53_MODE = cfg.mode;
      GLM53_HOST = cfg.host;
      GLM53_PORT = toString inst.port;
      PYTHONUNBUFFERED = "1";
      XDG_CACHE_HOME = "/var/cache/glm53";
      HOME = "/var/lib/glm53";
    }
    // setIf "GLM53_MODEL" cfg.model
    // setIf "GLM53_STORE" cfg.store
    // setIf "GLM53_RAM_CAP" cfg.ramCap
    // setIf "GLM53_CT_CPUS" inst.cpus
    // setIf "CUDA_VISIBLE_DEVICES" inst.gpu
    // cfg.environment;

    serviceConfig = {
      # READY=1 comes from granian's worker (a child process) once /health answers 200.
      Type = "notify";
      NotifyAccess = "all";
      ExecStart = "${lib.getExe cfg.package} serve";
      EnvironmentFile = lib.optional (cfg.apiKeyFile != null) cfg.apiKeyFile;
      DynamicUser = true;
      StateDirectory = "glm53";
      CacheDirectory = "glm53";
      UMask = "0077";
      TimeoutStartSec = "45min";
      TimeoutStopSec = "2min";
      KillMode = "mixed";
      Restart = "on-failure";
      RestartSec = "15s";
      OOMPolicy = "stop";
      LimitMEMLOCK = "infinity";
      LimitNOFILE = 65536;

      # GPU access: the NVIDIA nodes stay visible and are the only devices allowed.
      PrivateDevices = false;
      DevicePolicy = "closed";
      DeviceAllow = [
        "char-nvidia-frontend rw"
        "char-nvidia-uvm rw"
        "char-nvidia-caps rw"
        "/dev/nvidiactl rw"
        "/dev/nvidia-uvm rw"
        "/dev/nvidia-uvm-tools rw"
      ];
      NoNewPrivileges = true;
      CapabilityBoundingSet = "";
      ProtectSystem = "strict";
      ProtectHome = true;
      PrivateTmp = true;
      ProtectKernelTunables = true;
      ProtectKernelModules = true;
      ProtectKernelLogs = true;
      ProtectControlGroups = true;
      ProtectHostname = true;
      ProtectClock = true;
      RestrictAddressFamilies = [ "AF_UNIX" "AF_INET" "AF_INET6" ];
      RestrictNamespaces = true;
      RestrictRealtime = true;
      RestrictSUIDSGID = true;
      LockPersonality = true;
      SystemCallArchitectures = "native";
      # No MemoryDenyWriteExecute: Triton, NVRTC/PTX JIT and libffi closures need W+X pages.
    }
    // setIf "MemoryMax" cfg.memoryMax
    // setIf "CPUAffinity" inst.cpuAffinity
    // lib.optionalAttrs (inst.numaNode != null) {
      NUMAPolicy = "bind";
      NUMAMask = toString inst.numaNode;
    };
    };
in
{
  options.services.glm53 = {
    enable = mkEnableOption "glm53, an OpenAI-compatible GLM-5.3-Flash server";

    package = mkOption {
      type = types.package;
      default = self.packages.${system}.cuda;
      defaultText = lib.literalExpression "glm53.packages.\${pkgs.system}.cuda";
      description = "The glm53 package; the flake's `default` is the CPU-only build.";
    };

    model = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "/srv/models/GLM-5.3-Flash-exl3-3.05bpw";
      description = "Checkpoint directory (GLM53_MODEL); null serves the synthetic demo on the CPU.";
    };

    mode = mkOption {
      type = types.enum [ "auto" "exact" "fast" "nvme" "nvme-exact" ];
      default = "auto";
      description = "Tier mode (GLM53_MODE); `glm53 doctor` shows what auto picks on this host.";
    };

    host = mkOption {
      type = types.str;
      default = "127.0.0.1";
      description = "Address to bind (GLM53_HOST); set apiKeyFile too before leaving loopback.";
    };

    port = mkOption {
      type = types.port;
      default = 30000;
      description = "TCP port (GLM53_PORT).";
    };

    openFirewall = mkOption {
      type = types.bool;
      default = false;
      description = "Open the port in the firewall.";
    };

    store = mkOption {
      type = types.nullOr types.str;
      default = null;
      description = "NVMe expert store for the nvme modes (GLM53_STORE).";
    };

    ramCap = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "32G";
      description = "Cap of the RAM expert tier (GLM53_RAM_CAP), for the nvme modes.";
    };

    cpus = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "2-23";
      description = "CPUs of the CPU lane (GLM53_CT_CPUS); keep them inside cpuAffinity.";
    };

    cpuAffinity = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "0-23";
      description = "CPUAffinity= of the service: the cores of the GPU's NUMA node.";
    };

    memoryMax = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "124G";
      description = ''
        MemoryMax= of the service. It must cover what the mode keeps in RAM: exact and fast
        111.1 GiB (124G; fast's CPU lane reads the pinned experts in place, with no second
        copy), nvme with ramCap 32G 44.5 GiB (50G).
      '';
    };

    apiKeyFile = mkOption {
      type = types.nullOr types.path;
      default = null;
      description = ''
        An environment file with GLM53_API_KEY=..., kept out of the Nix store; clients then
        send `Authorization: Bearer <key>`.
      '';
    };

    instances = mkOption {
      type = types.listOf (types.submodule {
        options = {
          gpu = mkOption {
            type = types.ints.unsigned;
            description = "CUDA device index of this instance (CUDA_VISIBLE_DEVICES).";
          };
          port = mkOption {
            type = types.port;
            description = "TCP port of this instance (GLM53_PORT).";
          };
          cpus = mkOption {
            type = types.nullOr types.str;
            default = null;
            example = "26-47";
            description = "CPU lane CPUs (GLM53_CT_CPUS), on the GPU's NUMA node.";
          };
          cpuAffinity = mkOption {
            type = types.nullOr types.str;
            default = null;
            example = "24-47";
            description = "CPUAffinity= of this instance: the cores of its GPU's NUMA node.";
          };
          numaNode = mkOption {
            type = types.nullOr types.ints.unsigned;
            default = null;
            description = "NUMA node whose memory this instance binds to (NUMAPolicy=bind).";
          };
        };
      });
      default = [ ];
      example = lib.literalExpression ''
        [ { gpu = 0; port = 31000; cpus = "2-23"; cpuAffinity = "0-23"; numaNode = 0; }
          { gpu = 1; port = 31001; cpus = "26-47"; cpuAffinity = "24-47"; numaNode = 1; } ]
      '';
      description = ''
        One service per GPU, glm53-gpu<N> (`glm53 doctor` plans each); a router in front of
        them gives clients one address (docs/fleet.md). Empty: one service, glm53, with port,
        cpus and cpuAffinity above. Every other option applies to each instance.
      '';
    };

    environment = mkOption {
      type = types.attrsOf types.str;
      default = { };
      example = { GLM53_MAX_BATCH = "8"; GLM53_CONTEXT = "65536"; };
      description = "More GLM53_* settings, by variable name.";
    };
  };

  config = mkIf cfg.enable {
    networking.firewall.allowedTCPPorts =
      lib.optionals cfg.openFirewall (map (inst: inst.port) instances);
    systemd.services = builtins.listToAttrs (map
      (inst: { name = serviceName inst; value = service inst; })
      instances);
  };
}
