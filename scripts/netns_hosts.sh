#!/usr/bin/env bash
# Hosts on one machine: N network namespaces on a bridge, one command per namespace.
#
#   scripts/netns_hosts.sh [-n HOSTS] [-r RATE] [-d DELAY] [-b BURST] [-p PORT] [-R RACKS -u RACK_RATE]
#                          -- COMMAND [ARG...]
#   scripts/netns_hosts.sh [-r RATE] [-b BURST] [-u RACK_RATE] -s     (say the links' sizing, make nothing)
#
#   root namespace:  bridge ubr<pid> (no address: nothing routes from here into the hosts)
#                      |-- veth --> namespace ubep<pid>h0: eth0 10.231.0.1/24, lo
#                      |-- veth --> namespace ubep<pid>h1: eth0 10.231.0.2/24, lo
#                      ...
#
# Each host's eth0 sends through `tc netem rate RATE delay DELAY` (defaults 25gbit: a 25 GbE NIC,
# common on CPU servers; 15us one way: a switch hop and the kernel's TCP stack), so a message
# between hosts pays the delay once and the rate; ranks of one host talk over its own lo,
# unshaped. Where the kernel has no netem, a token bucket (tbf) keeps the rate, and no delay can be
# added. RATE is a whole number of bit, kbit, mbit, gbit or tbit per second (1gbit, 2500mbit).
# The bucket's BURST (bytes; default: the bytes RATE sends in 2 ms, and at least one 1514-byte
# Ethernet frame) is what may leave at line speed after a pause: kept that small, the rate holds
# per call (at 1gbit, 250000 bytes: a 2 MB message takes its 16 ms, where a 4 MB burst let it out
# at once). Before the command starts, one line on stderr says the link: its rate, its burst and
# its delay, or "no delay: kernel has no netem". Each namespace has its own /etc/hosts
# (/etc/netns/NAME/hosts) naming every host, so no address lookup waits on an unreachable DNS server.
#
# Racks (-R RACKS, at least 2, dividing HOSTS): consecutive hosts stand in RACKS racks, each on a
# bridge of its own (hosts 0..J-1 in rack 0, ...), and every rack bridge reaches a core bridge
# through a veth pair, its uplink, shaped in both directions by a token bucket at RACK_RATE (-u;
# the slower tier between racks; its burst: the bytes RACK_RATE sends in 2 ms, the same rule):
#
#   core bridge ubc<pid> --(uplink, tbf RACK_RATE each way)-- rack bridge ubr<pid>r0 -- hosts 0..J-1
#                        --(uplink, tbf RACK_RATE each way)-- rack bridge ubr<pid>r1 -- hosts J..2J-1
#
# so traffic between two hosts of one rack pays RATE, and between racks RATE and RACK_RATE. Before
# the command starts, a second line on stderr says the uplinks: their rate, burst and the racks.
#
# With -s the script prints the sizing it would use, `rate=RATE bytes_per_s=B burst=BYTES` (and
# with -u, `rack_rate=RATE rack_bytes_per_s=B rack_burst=BYTES`), and exits: nothing is made and no
# root is needed.
#
# COMMAND runs once in every namespace (as torchrun would on every host), with torchrun's
# settings in its environment: PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR (host 0's address),
# PET_MASTER_PORT; the same as NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT; and
# GLOO_SOCKET_IFNAME=eth0. So `-- torchrun --nproc-per-node 4 job.py` starts one agent per host.
#
# The exit status is the first failing host's (the others are then stopped), else 0. Everything
# made here is removed on exit, on Ctrl-C and on SIGTERM. Needs root and iproute2.
set -euo pipefail

hosts=2 rate=25gbit delay=15us burst="" port=29500 say_sizing=0 racks=1 rack_rate=""
burst_ms=2 frame=1514  # the bucket holds 2 ms at the rate, and at least one frame: a 1500-byte MTU and its header
usage() { sed -n '2,/^set -euo/{/^#/p}' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while getopts "n:r:d:b:p:R:u:sh" opt; do
    case $opt in
        n) hosts=$OPTARG ;;
        r) rate=$OPTARG ;;
        d) delay=$OPTARG ;;
        b) burst=$OPTARG ;;
        p) port=$OPTARG ;;
        R) racks=$OPTARG ;;
        u) rack_rate=$OPTARG ;;
        s) say_sizing=1 ;;
        *) usage ;;
    esac
done
shift $((OPTIND - 1))
[[ ${1:-} == -- ]] && shift

bytes_per_s() {  # bytes_per_s RATE: tc's rate units (SI prefixes, bits per second) as bytes per second
    local scale
    [[ $1 =~ ^([0-9]+)(bit|kbit|mbit|gbit|tbit)$ ]] || {
        echo "netns_hosts: -r must be a whole number of bit, kbit, mbit, gbit or tbit, got $1" >&2
        exit 2
    }
    case ${BASH_REMATCH[2]} in
        bit) scale=1 ;; kbit) scale=1000 ;; mbit) scale=1000000 ;; gbit) scale=1000000000 ;; tbit) scale=1000000000000 ;;
    esac
    echo $((BASH_REMATCH[1] * scale / 8))
}
rate_bytes=$(bytes_per_s "$rate")
if [[ -z $burst ]]; then
    burst=$((rate_bytes * burst_ms / 1000))
    ((burst >= frame)) || burst=$frame
fi
[[ $burst =~ ^[0-9]+$ ]] && ((burst >= frame)) || {
    echo "netns_hosts: -b must be a whole number of bytes, at least one $frame-byte frame, got $burst" >&2
    exit 2
}
burst_of() {  # burst_of BYTES_PER_S: the bucket's 2 ms at that rate, at least one frame
    local b=$(($1 * burst_ms / 1000))
    ((b >= frame)) || b=$frame
    echo "$b"
}
if [[ -n $rack_rate ]]; then
    rack_bytes=$(bytes_per_s "$rack_rate")
    rack_burst=$(burst_of "$rack_bytes")
fi
if ((say_sizing)); then
    echo "rate=$rate bytes_per_s=$rate_bytes burst=$burst${rack_rate:+ rack_rate=$rack_rate rack_bytes_per_s=$rack_bytes rack_burst=$rack_burst}"
    exit 0
fi
(($# > 0)) || usage
[[ $hosts =~ ^[0-9]+$ ]] && ((hosts >= 1 && hosts <= 250)) || { echo "netns_hosts: -n must be 1..250, got $hosts" >&2; exit 2; }
[[ $racks =~ ^[0-9]+$ ]] && ((racks >= 1 && hosts % racks == 0)) || {
    echo "netns_hosts: -R must be a whole number of racks that divides the $hosts hosts, got $racks" >&2
    exit 2
}
((racks == 1)) || [[ -n $rack_rate ]] || { echo "netns_hosts: -R $racks needs -u RACK_RATE (the uplinks)" >&2; exit 2; }
((EUID == 0)) || { echo "netns_hosts: needs root (network namespaces), running as uid $EUID" >&2; exit 3; }

tag=$$ bridge=ubr$$ namespaces=() pids=() links=()  # links: the bridges and the uplinks made here

cleanup() {
    trap - EXIT INT TERM
    local ns pid
    for ns in "${namespaces[@]}"; do  # every process left in our namespaces, and only those
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -TERM "$pid" 2>/dev/null || true; done
    done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    for ns in "${namespaces[@]}"; do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
        ip netns del "$ns" 2>/dev/null || true  # takes its veth pair with it
        rm -rf "/etc/netns/$ns"
    done
    for link in "${links[@]}"; do ip link del "$link" 2>/dev/null || true; done  # a veth takes its peer
}
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
trap cleanup EXIT

shape() {  # shape NS: eth0's egress, netem where the kernel has it, else tbf for the rate alone
    local said
    if ip netns exec "$1" tc qdisc add dev eth0 root netem rate "$rate" delay "$delay" limit 100000 2>/dev/null; then
        said="netns_hosts: link rate $rate, burst none (netem paces each packet), delay $delay one way (tc netem)"
    else  # the queue holds 50 ms at the rate: the 4 ranks of a host sending at once are delayed, not dropped
        ip netns exec "$1" tc qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms
        said="netns_hosts: link rate $rate, burst $burst bytes (tc tbf), no delay: kernel has no netem"
    fi
    [[ $1 == "${namespaces[0]}" ]] && echo "$said" >&2
    return 0
}

add_bridge() {  # add_bridge NAME
    ip link add "$1" type bridge
    links+=("$1")
    ip link set "$1" up
}
if ((racks == 1)); then
    add_bridge "$bridge"
else  # a bridge per rack, each joined to the core by its uplink, shaped both ways at RACK_RATE
    add_bridge "ubc$tag"
    for ((q = 0; q < racks; q++)); do
        add_bridge "${bridge}r$q"
        ip link add "uu${tag}r$q" type veth peer name "uc${tag}r$q"
        links+=("uu${tag}r$q")
        ip link set "uu${tag}r$q" master "${bridge}r$q" up
        ip link set "uc${tag}r$q" master "ubc$tag" up
        for end in "uu${tag}r$q" "uc${tag}r$q"; do
            tc qdisc add dev "$end" root tbf rate "$rack_rate" burst "$rack_burst" latency 50ms
        done
    done
    echo "netns_hosts: rack uplinks rate $rack_rate, burst $rack_burst bytes (tc tbf, each way), $racks racks of $((hosts / racks)) hosts" >&2
fi
# Every host's name, for each form of its address: c10d looks up each peer's (getnameinfo, on an
# IPv6 socket: ::ffff:10.231.0.2) and would otherwise ask a DNS server no namespace can reach.
names=$'127.0.0.1 localhost\n::ffff:127.0.0.1 localhost\n::1 localhost\n'
for ((i = 0; i < hosts; i++)); do
    names+="10.231.0.$((i + 1)) ubep${tag}h$i"$'\n'"::ffff:10.231.0.$((i + 1)) ubep${tag}h$i"$'\n'
done

for ((i = 0; i < hosts; i++)); do
    ns=ubep${tag}h$i
    ip netns add "$ns"
    namespaces+=("$ns")
    mkdir -p "/etc/netns/$ns"  # `ip netns exec` mounts this over /etc: a namespace's own hosts file,
    printf '%s' "$names" >"/etc/netns/$ns/hosts"  # so no lookup waits on a DNS server it cannot reach
    ip link add "uv${tag}h$i" type veth peer name eth0 netns "$ns"
    if ((racks == 1)); then
        ip link set "uv${tag}h$i" master "$bridge" up
    else
        ip link set "uv${tag}h$i" master "${bridge}r$((i / (hosts / racks)))" up
    fi
    ip netns exec "$ns" ip link set lo up
    ip netns exec "$ns" ip addr add "10.231.0.$((i + 1))/24" dev eth0
    ip netns exec "$ns" ip link set eth0 up
    shape "$ns"
done

for ((i = 0; i < hosts; i++)); do
    ip netns exec "${namespaces[i]}" env \
        NNODES="$hosts" NODE_RANK="$i" MASTER_ADDR=10.231.0.1 MASTER_PORT="$port" \
        PET_NNODES="$hosts" PET_NODE_RANK="$i" PET_MASTER_ADDR=10.231.0.1 PET_MASTER_PORT="$port" \
        GLOO_SOCKET_IFNAME=eth0 "$@" &
    pids+=($!)
done

running=("${pids[@]}") status=0
while ((${#running[@]} > 0)); do
    wait -n -p done_pid "${running[@]}" || { status=$?; break; }  # the first failure stops the rest
    left=()
    for pid in "${running[@]}"; do ((pid == done_pid)) || left+=("$pid"); done
    running=("${left[@]}")
done
exit "$status"
