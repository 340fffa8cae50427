# Which GPU install fits this machine (sourced by scripts/setup_gpu.sh; tests/unit/test_setup_gpu_choice.py).
#
#   gpu_install_choice   prints "KIND<TAB>why" and returns 0, or prints the reason and returns 1, where KIND is
#     container  an NGC PyTorch container (NVIDIA_PYTORCH_VERSION is set: NGC's PyTorch images export it):
#                its own Python, torch, Transformer Engine and apex, the lock's other packages beside them
#     cu130      PyPI's CUDA 13.0 wheels of requirements/gpu.lock: needs a driver >= 580 (CUDA 13.0's minimum)
#     cu12       the CUDA 12.x wheel set (requirements/gpu-cu12.lock): drivers 525-579 (CUDA 12's minor-version
#                compatibility starts at 525.60.13)
#   MGTPO_GPU_INSTALL=container|cu130|cu12 chooses by intent (nothing is probed).
CU130_MIN_DRIVER=580
CU12_MIN_DRIVER=525

gpu_install_choice() {
  case "${MGTPO_GPU_INSTALL:-}" in
    container|cu130|cu12) printf '%s\tMGTPO_GPU_INSTALL=%s (chosen by intent)\n' "$MGTPO_GPU_INSTALL" "$MGTPO_GPU_INSTALL"; return 0 ;;
    "") ;;
    *) echo "MGTPO_GPU_INSTALL=$MGTPO_GPU_INSTALL is not one of container, cu130, cu12"; return 1 ;;
  esac
  if [ -n "${NVIDIA_PYTORCH_VERSION:-}" ]; then
    printf 'container\tNGC PyTorch container %s (NVIDIA_PYTORCH_VERSION): its torch, TE and apex are used\n' \
      "$NVIDIA_PYTORCH_VERSION"
    return 0
  fi
  local driver major
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' ' || true)
  major=${driver%%.*}
  if ! [[ "$major" =~ ^[0-9]+$ ]]; then
    echo "nvidia-smi reports no driver version ('${driver}'): run this on a GPU node, or set MGTPO_GPU_INSTALL"
    return 1
  fi
  if [ "$major" -ge "$CU130_MIN_DRIVER" ]; then
    printf 'cu130\tdriver %s >= %s runs CUDA 13.0\n' "$driver" "$CU130_MIN_DRIVER"
  elif [ "$major" -ge "$CU12_MIN_DRIVER" ]; then
    printf 'cu12\tdriver %s < %s (CUDA 13 needs it) but >= %s (CUDA 12.x)\n' "$driver" "$CU130_MIN_DRIVER" \
      "$CU12_MIN_DRIVER"
  else
    echo "driver $driver is older than CUDA 12's minimum ($CU12_MIN_DRIVER): update the driver, or use an NGC" \
      "PyTorch container with CUDA forward compatibility (docs/gpu.md)"
    return 1
  fi
}
