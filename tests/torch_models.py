"""Tiny PyTorch models the import tests compare against torch (forward, gradients, steps).
Imported only when torch is installed."""

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, with a projection shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class SmallResNet(nn.Module):
    def __init__(self, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.layer1 = nn.Sequential(BasicBlock(4, 4))
        self.layer2 = nn.Sequential(BasicBlock(4, 8, stride=2), BasicBlock(8, 8))
        self.fc = nn.Linear(8, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.stem(x))), 2)
        x = self.layer2(self.layer1(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class DecoderBlock(nn.Module):
    """GPT-style: pre-norm causal self-attention (hand-written heads) and a GELU MLP."""

    def __init__(self, d: int = 16, heads: int = 2, vocab: int = 11, context: int = 8):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        b, t = ids.shape
        x = self.tok(ids) + self.pos(torch.arange(t))
        q, k, v = self.qkv(self.ln1(x)).split(x.size(-1), dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        x = x + self.mlp(self.ln2(x))
        return self.head(x)


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, d: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.token_mlp = nn.Sequential(
            nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens)
        )
        self.ln2 = nn.LayerNorm(d)
        self.channel_mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = x + self.token_mlp(self.ln1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.ln2(x))


class MLPMixer(nn.Module):
    """MLP-Mixer on 8x8 images in 4x4 patches."""

    def __init__(self, d: int = 8, classes: int = 5):
        super().__init__()
        self.patch = nn.Conv2d(3, d, 4, stride=4)
        self.blocks = nn.Sequential(MixerBlock(4, d), MixerBlock(4, d))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        return self.head(self.ln(self.blocks(x)).mean(dim=1))


def transformer_layer():
    return nn.TransformerEncoderLayer(
        d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True
    )
