#pragma once
#include <torch/torch.h>
#include <ddpkit/ddpkit.h>
